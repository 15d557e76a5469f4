package devices

import (
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
)

// snapshot is one complete netlink dump, with the pod CIDRs known when it
// was taken.
type snapshot struct {
	links []netlink.Link
	addrs []netlink.Addr
	// routes are the unicast routes of every routing table but local;
	// nil when --devices is set (routes are not dumped).
	routes []netlink.Route
	// podPools are the node's own pod CIDRs (--pod-cidr, the Node's
	// spec.podCIDRs): a device holding an address in one is the pods'
	// gateway, a pod interface.
	podPools []netip.Prefix
}

// portMatch is a device that --devices names but that cannot be selected
// because it is a port of master.
type portMatch struct {
	name, master string
}

// desired computes the rows of egress-devices, by interface index, from a
// dump. It also returns the bridge/bond/team ports that --devices matched.
func desired(s snapshot, sel *selector) (map[int]*tables.EgressDevice, []portMatch) {
	byIndex := make(map[int]netlink.Link, len(s.links))
	for _, l := range s.links {
		byIndex[l.Attrs().Index] = l
	}
	var reasons map[int]coverage
	if sel == nil {
		reasons = routeCoverage(s.routes, byIndex)
	}
	rows := make(map[int]*tables.EgressDevice, len(s.links))
	names := make(map[string]struct{}, len(s.links))
	var ports []portMatch
	for _, l := range s.links {
		a := l.Attrs()
		if _, dup := names[a.Name]; dup {
			// Names are unique in the table. A dump caught in the middle
			// of a rename is repaired by the dump its event triggers.
			continue
		}
		names[a.Name] = struct{}{}
		d := &tables.EgressDevice{
			Index:    a.Index,
			Name:     a.Name,
			Up:       a.Flags&net.FlagUp != 0 && a.Flags&net.FlagRunning != 0,
			Ethernet: a.EncapType == "ether",
			L3:       isL3(l),
			Loopback: a.Flags&net.FlagLoopback != 0,
		}
		switch {
		case d.Loopback:
			// Loopback has a row for its addresses only (BGP and anycast
			// nodes hold the node's address there and the routes' src
			// picks it): nothing leaves through it, so it is never
			// selected.
		case sel == nil:
			if c, ok := reasons[a.Index]; ok {
				d.Selected, d.Reason = true, c.reason
			}
		default:
			if p := sel.match(a.Name); p != "" {
				d.Selected, d.Reason = true, "--devices "+p
			}
		}
		if master, ok := byIndex[a.MasterIndex]; ok && d.Selected && isL2Master(master) {
			d.Selected = false
			d.Reason = "port of " + master.Attrs().Name
			if sel != nil {
				ports = append(ports, portMatch{name: a.Name, master: master.Attrs().Name})
			}
		}
		rows[a.Index] = d
	}
	addAddresses(rows, s.addrs)
	if sel == nil {
		excludePodGateways(rows, reasons, s.podPools)
	}
	return rows, ports
}

// coverage is why a device carries traffic the node forwards: the best
// of its routes.
type coverage struct {
	reason string
	// rank orders the reasons: a default route (0) before a route through
	// a gateway (1) before a connected route (2).
	rank int
}

// routeCoverage finds, from the routes of every table (a table other than
// main is there for an ip rule: a secondary uplink's own table, as AWS's
// VPC CNI and multi-homed nodes make them), the devices a forwarded packet
// can leave through, each with its best reason: every device with a route
// to a global unicast destination, the default route included, but for a route to a single address without a gateway on a
// veth, which is a routed CNI's route to one of its pods (Calico, the
// bridge-less ptp plugin, AWS's VPC CNI). Link-local destinations
// (fe80::/64 is on every device) select nothing.
func routeCoverage(routes []netlink.Route, links map[int]netlink.Link) map[int]coverage {
	out := make(map[int]coverage)
	note := func(index int, c coverage) {
		if index <= 0 {
			return
		}
		if prev, ok := out[index]; !ok || c.rank < prev.rank {
			out[index] = c
		}
	}
	for _, r := range routes {
		if !routingTable(r.Table) || r.Type != unix.RTN_UNICAST {
			continue
		}
		table := ""
		if r.Table != unix.RT_TABLE_MAIN {
			table = fmt.Sprintf(" (table %d)", r.Table)
		}
		dst, isDefault := routeDst(r)
		if !isDefault && (!dst.IsValid() || !dst.Addr().IsGlobalUnicast()) {
			continue
		}
		hops := []*netlink.NexthopInfo{{LinkIndex: r.LinkIndex, Gw: r.Gw}}
		if len(r.MultiPath) > 0 {
			hops = r.MultiPath
		}
		for _, h := range hops {
			switch {
			case isDefault:
				note(h.LinkIndex, coverage{reason: "default route" + table, rank: 0})
			case h.Gw != nil:
				note(h.LinkIndex, coverage{reason: "route " + dst.String() + " via " + h.Gw.String() + table, rank: 1})
			case dst.IsSingleIP() && isVeth(links[h.LinkIndex]):
				// a route to one pod through its veth
			default:
				note(h.LinkIndex, coverage{reason: "route " + dst.String() + table, rank: 2})
			}
		}
	}
	return out
}

// excludePodGateways deselects the devices that hold an address in one of
// the node's pod CIDRs: the pods' gateway (a bridge CNI's cni0 or cbr0,
// the ptp plugin's host-side veths, Cilium's cilium_host). Traffic leaving
// through them goes to the node's own pods. A device with a default route
// is never one: a pod CIDR given too wide must not stop the uplink's
// masquerading.
func excludePodGateways(rows map[int]*tables.EgressDevice, reasons map[int]coverage, pools []netip.Prefix) {
	if len(pools) == 0 {
		return
	}
	for _, d := range rows {
		if !d.Selected || reasons[d.Index].rank == 0 {
			continue
		}
		for _, a := range d.Addresses {
			if i := slices.IndexFunc(pools, func(p netip.Prefix) bool { return p.Contains(a) }); i >= 0 {
				d.Selected = false
				d.Reason = "pod gateway (" + a.String() + " in pod CIDR " + pools[i].String() + ")"
				break
			}
		}
	}
}

// routeDst returns a route's destination and whether it is a default
// route. netlink reports a default route's destination as nil or as the
// zero prefix, depending on the version.
func routeDst(r netlink.Route) (netip.Prefix, bool) {
	if r.Dst == nil {
		return netip.Prefix{}, true
	}
	ip, ok := netip.AddrFromSlice(r.Dst.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	ones, _ := r.Dst.Mask.Size()
	p := netip.PrefixFrom(ip.Unmap(), ones)
	return p, ones == 0
}

// routeMatters reports whether a route can change which devices are
// covered: a unicast route of a routing table (routingTable) to a global
// unicast destination (IsGlobalUnicast: not link-local, multicast,
// loopback or unspecified; private ranges included).
func routeMatters(r netlink.Route) bool {
	if !routingTable(r.Table) || r.Type != unix.RTN_UNICAST {
		return false
	}
	dst, isDefault := routeDst(r)
	return isDefault || (dst.IsValid() && dst.Addr().IsGlobalUnicast())
}

// routingTable reports whether routes of table may carry forwarded
// packets: every table but local (the node's own and broadcast addresses)
// and the unspecified 0. Which tables ip rules use is not known here (no
// rule events in netlink): a table none uses only selects a device that
// forwarded traffic may not leave through, at the cost of attached
// programs that see no packet to translate.
func routingTable(table int) bool {
	return table != unix.RT_TABLE_LOCAL && table != unix.RT_TABLE_UNSPEC
}

func isVeth(l netlink.Link) bool {
	return l != nil && l.Type() == "veth"
}

// isL3 reports whether packets on link start at the network header, where
// the L3 variant of the programs expects them. The encapsulation names are
// netlink's for ARPHRD_NONE (tun, WireGuard), ARPHRD_TUNNEL (ipip),
// ARPHRD_TUNNEL6 (ip6tnl), ARPHRD_SIT, ARPHRD_IPGRE, ARPHRD_IP6GRE (823),
// ARPHRD_PPP and ARPHRD_RAWIP (519). A GRE device without a remote
// (NBMA mode) has header_ops that prepend the outer IP header before tc
// sees the packet, so it is not one.
func isL3(link netlink.Link) bool {
	switch link.Attrs().EncapType {
	case "none", "ipip", "tunnel6", "sit", "ppp", "unknown519":
		return true
	case "gre", "unknown823":
		gre, ok := link.(*netlink.Gretun)
		return ok && gre.Remote != nil && !gre.Remote.IsUnspecified()
	}
	return false
}

// isL2Master reports whether link forwards frames for its ports, which then
// carry no routing (and no masquerading) of their own. A VRF is not one:
// its members are routed devices.
func isL2Master(link netlink.Link) bool {
	switch link.Type() {
	case "bridge", "bond", "team", "openvswitch":
		return true
	}
	return false
}

// addAddresses fills Addresses and the SNAT addresses. addrs are in the
// kernel's order, which decides which address is primary.
func addAddresses(rows map[int]*tables.EgressDevice, addrs []netlink.Addr) {
	for _, a := range addrs {
		d, ok := rows[a.LinkIndex]
		if !ok || a.IPNet == nil {
			continue
		}
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		if !slices.Contains(d.Addresses, ip) {
			d.Addresses = append(d.Addresses, ip)
		}
		if d.Loopback {
			continue // node addresses, never a SNAT address of its own
		}
		switch {
		case ip.Is4() && !d.SNATv4.IsValid() && isPrimaryV4(a):
			d.SNATv4 = ip
		case ip.Is6() && !d.SNATv6.IsValid() && isStableV6(a):
			d.SNATv6 = ip
		}
	}
	for _, d := range rows {
		slices.SortFunc(d.Addresses, netip.Addr.Compare)
	}
}

// isPrimaryV4 accepts a global IPv4 address that is not a secondary one
// (an address in a subnet the device already has an address in).
func isPrimaryV4(a netlink.Addr) bool {
	return a.Scope == unix.RT_SCOPE_UNIVERSE && a.Flags&unix.IFA_F_SECONDARY == 0
}

// isStableV6 accepts a global IPv6 address that is usable as a source now
// and meant to last: not tentative or failed in duplicate address
// detection, not deprecated, not a temporary (privacy) address.
func isStableV6(a netlink.Addr) bool {
	const unusable = unix.IFA_F_TENTATIVE | unix.IFA_F_DADFAILED | unix.IFA_F_DEPRECATED | unix.IFA_F_TEMPORARY
	return a.Scope == unix.RT_SCOPE_UNIVERSE && a.Flags&unusable == 0
}
