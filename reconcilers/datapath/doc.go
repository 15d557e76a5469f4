// Package datapath loads the eBPF masquerade datapath (package bpf): at
// start it loads the programs with their pinned maps and sets the NAT port
// range, lifetimes and port policy, and it provides the loaded datapath
// (Handle) and the datapath's flags (Config) in the hive. The kernel
// objects the loaded datapath is given are each written by a reconciler of
// their own, which takes the Handle from the hive:
//
//	reconcilers/tcattach     datapath-devices → tcx links (or clsact filters), egress_devs
//	reconcilers/masqrules    masquerade-rule-sources → masq_rules_v4/v6
//	reconcilers/masqsources  masquerade-sources → masq_src_v4/v6
//	reconcilers/nodeaddrs    node-addresses → node_addrs_v4/v6
//	reconcilers/natgc        expiry of idle NAT pairs in nat_v4/v6
//
// It is the one reconcilers/ package other reconcilers may import
// (architecture_test.go): it is the object they all write into, and it
// imports no reconciler. A new map is a copy of reconcilers/nodeaddrs.
//
// Attachments are tcx links pinned under <bpf-root>/ipmasq/links/, so the
// programs stay attached while the agent restarts; a new agent replaces the
// program inside the existing link atomically (no moment without
// translation) instead of detaching and attaching again. NAT state is in
// pinned maps too, so established flows survive a restart.
package datapath
