// Package datapath runs the eBPF masquerade datapath (package bpf): it
// loads the programs with their pinned maps, fills the maps the programs
// read (NAT port range, masquerade sources from the pod-cidrs table, followed live; the node's
// addresses), derives the datapath-devices table from the selected
// egress-devices and reconciles it into tcx attachments and SNAT addresses,
// and expires idle NAT entries.
//
// Attachments are tcx links pinned under <bpf-root>/ipmasq/links/, so the
// programs stay attached while the agent restarts; a new agent replaces the
// program inside the existing link atomically (no moment without
// translation) instead of detaching and attaching again. NAT state is in
// pinned maps too, so established flows survive a restart.
package datapath
