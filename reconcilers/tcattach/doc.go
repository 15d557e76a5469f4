// Package tcattach attaches the loaded datapath's programs (package
// datapath's Handle) to the devices of table datapath-devices: tcx links
// pinned under <bpf-root>/ipmasq/links/ (or clsact filters, per
// --tc-attach-mode), and the device's SNAT addresses in egress_devs. The
// links stay pinned while the agent restarts; a new agent replaces the
// program inside an existing link atomically. Detach takes them all off the
// node for `ipmasq-agent uninstall`.
package tcattach
