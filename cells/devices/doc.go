// Package devices is the devices cell: it keeps the egress-devices table in
// step with the node's network devices, so that the datapath knows where to
// masquerade and to which address.
//
// The flow is one way:
//
//	netlink (links, addresses, routes of every table) + table pod-cidrs
//	  ──▶ devices cell ──▶ table egress-devices ──▶ datapath-tables ──▶ tc-attach ──▶ tc programs, device maps
//
// The cell subscribes to link, address and route notifications, but uses
// them only as a trigger: after a short quiet period (a burst of events,
// e.g. a device coming up with several addresses, costs one pass) it dumps
// links, addresses and routes afresh and rewrites the rows that
// differ; a change of the pod CIDRs triggers a pass too. A lost notification therefore cannot leave the table
// wrong for longer than the next event, and a subscription that fails (a
// socket buffer overflow ends it) is re-opened and followed by a full dump.
// The table is marked initialized after the first complete dump, so a
// reader waiting on Initialized never sees a partial list.
//
// Every link has a row. Loopback's is there for its addresses, which are
// the node's (BGP and anycast nodes hold the node's address on lo, and the
// routes' src picks it as the source of masqueraded flows): it is never
// selected and has no SNAT address. Selected says whether traffic leaving
// through the device is masqueraded:
//
//   - with --devices, the devices whose name is listed or starts with a
//     listed prefix ("eth+" selects eth0, eth1, ...);
//   - without it, every device a forwarded packet can leave through, as
//     the upstream agent's POSTROUTING rule (no -o) covers every device:
//     the devices with a unicast route to a global destination in any
//     table but local (a table an ip rule uses: a secondary uplink's)
//     (a default route, IPv4 or IPv6, each hop of a multipath route; a
//     route via a gateway; a connected subnet). Never the pods' own
//     interfaces: a route to a single address without a gateway on a veth
//     (a routed CNI's route to one pod) does not count, and a device
//     holding an address in one of the node's pod CIDRs (the pods'
//     gateway: a bridge CNI's cni0, the ptp plugin's veths) is not
//     selected, unless it has a default route.
//
// Reason says why a device is selected ("default route", "route
// 192.0.2.0/24 via 10.1.0.1", "route 10.1.0.0/24", "--devices eth+") or
// why a device with routes is not ("pod gateway (...)", "port of br0").
//
// A port of a bridge, bond or team is never selected, even when --devices
// names it: its packets are routed, and masqueraded, on the master device,
// which holds the address. A warning says so when a pattern matches one.
//
// The masquerade (SNAT) address of each family is the device's primary
// address: for IPv4 the first non-secondary address of global scope in the
// kernel's order, which is the address the kernel itself picks as source;
// for IPv6 the first global address that is neither tentative (duplicate
// address detection still running), DAD-failed, deprecated nor temporary
// (a privacy address). A device without such an address has none, and the
// datapath does not masquerade that family on it.
//
// The cell watches the agent's own network namespace. A test or an embedder
// watching another namespace provides a *Netns (tests: testkit/netnstest).
//
// Try it on a running agent:
//
//	db/show egress-devices
//	db/get --index=name egress-devices eth0
//	db/list --index=selected egress-devices true
package devices
