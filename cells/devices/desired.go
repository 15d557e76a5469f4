package devices

import (
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
)

// snapshot is one complete netlink dump.
type snapshot struct {
	links []netlink.Link
	addrs []netlink.Addr
	// defaultRoutes are the indexes of the links that carry a main-table
	// default route; nil when --devices is set (routes are not dumped).
	defaultRoutes map[int]struct{}
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
			_, d.Selected = s.defaultRoutes[a.Index]
		default:
			d.Selected = sel.matches(a.Name)
		}
		if master, ok := byIndex[a.MasterIndex]; ok && d.Selected && isL2Master(master) {
			d.Selected = false
			if sel != nil {
				ports = append(ports, portMatch{name: a.Name, master: master.Attrs().Name})
			}
		}
		rows[a.Index] = d
	}
	addAddresses(rows, s.addrs)
	return rows, ports
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

// isDefaultRoute reports whether r is a unicast default route in the main
// table. netlink reports a default route's destination as nil or as the
// zero prefix, depending on the version.
func isDefaultRoute(r netlink.Route) bool {
	if r.Table != unix.RT_TABLE_MAIN || r.Type != unix.RTN_UNICAST {
		return false
	}
	if r.Dst == nil {
		return true
	}
	ones, _ := r.Dst.Mask.Size()
	return ones == 0
}

// addRouteLinks records the devices a default route leaves through: its
// own device, or each hop's of a multipath route.
func addRouteLinks(links map[int]struct{}, r netlink.Route) {
	if r.LinkIndex > 0 {
		links[r.LinkIndex] = struct{}{}
	}
	for _, hop := range r.MultiPath {
		if hop.LinkIndex > 0 {
			links[hop.LinkIndex] = struct{}{}
		}
	}
}
