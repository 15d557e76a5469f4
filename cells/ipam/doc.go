// Package ipam is the IPAM cell: it hands out endpoint addresses from the
// node's --pod-cidr pools, records them in the endpoints table and persists
// them under --state-dir before answering, so an allocation is never lost
// by a crash or forgotten on restart. The endpoints are restored from disk
// before the table is marked initialized, so the rules controller never
// derives rules from a partial view.
//
// Allocations answer with the no-masquerade CIDRs of the address's family,
// read from the nonmasq-cidrs table in memory (never the file). A request
// that arrives before the first config load waits for it, bounded by
// --ipam-config-wait, and never answers with an empty or guessed list.
package ipam
