// Package natgc expires idle NAT pairs and inbound flow records in the
// loaded datapath's nat_v4/v6 (package datapath's Handle), and at once the
// pairs translated to an address the node no longer has. The programs
// apply the same lifetimes on their own; the collector frees the entries.
package natgc
