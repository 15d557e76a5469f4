// Package bpfmap keeps a pinned BPF map equal to a StateDB table.
//
// It is the last step of the flow the agent is built around:
//
//	table (desired rows) → reconciler → bpfmap.Ops → bpfmap.Map → kernel map
//
// The StateDB reconciler hands changed rows to [Ops], which turns each row
// into one entry of its family's map ([Entries]: a map per address family,
// one table) and writes it through [Map]. Map keeps an in-memory copy of
// what the kernel map holds, so a row that did not change the entry costs
// no syscall, and many changes go to the kernel as one batch. Pruning diffs
// the table against the map as read back from the kernel and writes only the
// difference: a map is never flushed, so an agent restart leaves the datapath
// untouched when the configuration did not change.
//
// [OpenPinned] opens (or creates) the map under the bpffs directory and
// replaces it only when its layout no longer matches the program's. The
// package knows no map layout: key and value types and map specs come from
// the bpf2go output (package bpf), and the maps from a [Loader].
package bpfmap
