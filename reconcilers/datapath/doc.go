// Package datapath runs the eBPF masquerade datapath (package bpf): it
// loads the programs with their pinned maps, sets the NAT port range, and
// reconciles the tables that cells/datapathtables derives into the kernel:
// datapath-devices into tcx attachments and SNAT addresses,
// masquerade-rule-sources into masq_rules_v4/v6, masquerade-sources into
// masq_src_v4/v6 and node-addresses into node_addrs_v4/v6 (each through
// bpfmap's generic map operations). It also expires idle NAT entries.
//
// Attachments are tcx links pinned under <bpf-root>/ipmasq/links/, so the
// programs stay attached while the agent restarts; a new agent replaces the
// program inside the existing link atomically (no moment without
// translation) instead of detaching and attaching again. NAT state is in
// pinned maps too, so established flows survive a restart.
package datapath
