package devices

import (
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
)

func link(index int, name string, master int) netlink.Link {
	return &netlink.Veth{LinkAttrs: netlink.LinkAttrs{
		Index: index, Name: name, MasterIndex: master, EncapType: "ether",
		Flags: net.FlagUp | net.FlagRunning,
	}}
}

func addr(index int, cidr string, scope, flags int) netlink.Addr {
	ip, ipnet, err := net.ParseCIDR(cidr)
	if err != nil {
		panic(err)
	}
	ipnet.IP = ip
	return netlink.Addr{IPNet: ipnet, LinkIndex: index, Scope: scope, Flags: flags}
}

const (
	global = unix.RT_SCOPE_UNIVERSE
	linkSc = unix.RT_SCOPE_LINK
)

func TestSNATAddresses(t *testing.T) {
	snap := snapshot{
		links: []netlink.Link{
			&netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: 1, Name: "lo", Flags: net.FlagLoopback | net.FlagUp}},
			link(2, "eth0", 0),
			link(3, "eth1", 0),
			&netlink.Wireguard{LinkAttrs: netlink.LinkAttrs{Index: 4, Name: "wg0", EncapType: "none"}},
		},
		addrs: []netlink.Addr{
			addr(1, "127.0.0.1/8", unix.RT_SCOPE_HOST, 0),
			addr(1, "10.9.9.9/32", global, 0),
			addr(2, "169.254.1.1/16", linkSc, 0),
			addr(2, "10.0.0.5/24", global, 0),
			addr(2, "10.0.0.6/24", global, unix.IFA_F_SECONDARY),
			addr(2, "192.168.1.5/24", global, 0),
			addr(2, "fe80::1/64", linkSc, 0),
			addr(2, "2001:db8::9/64", global, unix.IFA_F_TENTATIVE),
			addr(2, "2001:db8::8/64", global, unix.IFA_F_TEMPORARY),
			addr(2, "2001:db8::7/64", global, unix.IFA_F_DEPRECATED),
			addr(2, "2001:db8::6/64", global, unix.IFA_F_DADFAILED),
			addr(2, "2001:db8::5/64", global, unix.IFA_F_PERMANENT),
			addr(2, "2001:db8::4/64", global, 0),
			// The kernel lists secondaries after the primaries; the rule
			// does not depend on it.
			addr(3, "10.1.0.6/24", global, unix.IFA_F_SECONDARY),
			addr(3, "fe80::2/64", linkSc, 0),
			addr(3, "fe80::2/64", linkSc, 0),
			addr(4, "10.2.0.1/32", global, 0),
		},
	}
	// lo carries the default route here: it is still never selected.
	snap.routes = []netlink.Route{defaultVia(1)}
	rows, _ := desired(snap, nil)
	check := func(index int, v4, v6 string, addrs ...string) {
		t.Helper()
		d := rows[index]
		if got := addrString(d.SNATv4); got != v4 {
			t.Errorf("%s: SNATv4 %q, want %q", d.Name, got, v4)
		}
		if got := addrString(d.SNATv6); got != v6 {
			t.Errorf("%s: SNATv6 %q, want %q", d.Name, got, v6)
		}
		var got []string
		for _, a := range d.Addresses {
			got = append(got, a.String())
		}
		if !slices.Equal(got, addrs) {
			t.Errorf("%s: addresses %v, want %v", d.Name, got, addrs)
		}
	}
	// Loopback's addresses are node addresses (a BGP node's address on lo),
	// but it masquerades nothing and has no SNAT address.
	check(1, "", "", "10.9.9.9", "127.0.0.1")
	if lo := rows[1]; !lo.Loopback || lo.Selected {
		t.Errorf("lo: Loopback %v Selected %v, want true false", lo.Loopback, lo.Selected)
	}
	loSel, err := parseSelector([]string{"lo", "eth+"})
	if err != nil {
		t.Fatal(err)
	}
	if sel, _ := desired(snap, loSel); sel[1].Selected {
		t.Error("lo is selected by --devices=lo")
	}
	check(2, "10.0.0.5", "2001:db8::5", "10.0.0.5", "10.0.0.6", "169.254.1.1", "192.168.1.5",
		"2001:db8::4", "2001:db8::5", "2001:db8::6", "2001:db8::7", "2001:db8::8", "2001:db8::9", "fe80::1")
	check(3, "", "", "10.1.0.6", "fe80::2")
	check(4, "10.2.0.1", "", "10.2.0.1")
	if !rows[2].Ethernet || rows[4].Ethernet || rows[2].L3 || !rows[4].L3 {
		t.Error("Ethernet and L3 do not follow the link's encapsulation")
	}
	if !rows[2].Up || rows[4].Up {
		t.Error("Up does not follow IFF_UP|IFF_RUNNING")
	}
}

func addrString(a netip.Addr) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}

func selectedNames(rows map[int]*tables.EgressDevice) []string {
	var names []string
	for _, d := range rows {
		if d.Selected {
			names = append(names, d.Name)
		}
	}
	slices.Sort(names)
	return names
}

func TestSelection(t *testing.T) {
	links := []netlink.Link{
		link(2, "eth0", 0),
		link(3, "eth1", 0),
		link(4, "ens5", 0),
		&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Index: 5, Name: "br0"}},
		link(6, "eth2", 5), // bridge port
		&netlink.Vrf{LinkAttrs: netlink.LinkAttrs{Index: 7, Name: "vrf-blue"}},
		link(8, "eth3", 7), // VRF member: routed, selectable
	}
	for _, tc := range []struct {
		name     string
		patterns []string
		routes   []netlink.Route
		want     []string
		ports    []portMatch
	}{
		{name: "default routes", routes: []netlink.Route{defaultVia(3), defaultVia(8)}, want: []string{"eth1", "eth3"}},
		{name: "no route", routes: []netlink.Route{}, want: nil},
		{name: "default route on a bridge port", routes: []netlink.Route{defaultVia(5), defaultVia(6)}, want: []string{"br0"}},
		{name: "names", patterns: []string{"eth0", "ens5"}, want: []string{"ens5", "eth0"}},
		{name: "prefix", patterns: []string{"eth+"}, want: []string{"eth0", "eth1", "eth3"},
			ports: []portMatch{{name: "eth2", master: "br0"}}},
		{name: "name and prefix", patterns: []string{"br0", "en+"}, want: []string{"br0", "ens5"}},
		{name: "pattern ignores routes", patterns: []string{"ens5"}, routes: []netlink.Route{defaultVia(2)},
			want: []string{"ens5"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sel, err := parseSelector(tc.patterns)
			if err != nil {
				t.Fatal(err)
			}
			rows, ports := desired(snapshot{links: links, routes: tc.routes}, sel)
			if got := selectedNames(rows); !slices.Equal(got, tc.want) {
				t.Errorf("selected %v, want %v", got, tc.want)
			}
			if !slices.Equal(ports, tc.ports) {
				t.Errorf("ports %v, want %v", ports, tc.ports)
			}
			if len(rows) != len(links) {
				t.Errorf("%d rows for %d links", len(rows), len(links))
			}
		})
	}
}

func prefix(s string) *net.IPNet {
	_, n, err := net.ParseCIDR(s)
	if err != nil {
		panic(err)
	}
	return n
}

func defaultVia(index int) netlink.Route {
	return netlink.Route{Table: unix.RT_TABLE_MAIN, Type: unix.RTN_UNICAST, LinkIndex: index, Gw: net.ParseIP("10.0.0.1")}
}

// TestRouteCoverage: which routes make their devices egress devices, and
// the reason each device is given.
func TestRouteCoverage(t *testing.T) {
	main, uni := unix.RT_TABLE_MAIN, unix.RT_TABLE_UNSPEC
	links := map[int]netlink.Link{
		2: link(2, "eth0", 0),
		3: &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: 3, Name: "eth1"}},
		4: link(4, "cali1", 0),
	}
	for _, tc := range []struct {
		name  string
		route netlink.Route
		want  map[int]string
	}{
		{"nil destination", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2}, map[int]string{2: "default route"}},
		{"0.0.0.0/0", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("0.0.0.0/0")}, map[int]string{2: "default route"}},
		{"::/0", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("::/0")}, map[int]string{3: "default route"}},
		{"multipath", netlink.Route{Table: main, Type: unix.RTN_UNICAST, MultiPath: []*netlink.NexthopInfo{
			{LinkIndex: 2}, {LinkIndex: 4}}}, map[int]string{2: "default route", 4: "default route"}},
		{"via a gateway", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("192.0.2.0/24"), Gw: net.ParseIP("10.1.0.1")},
			map[int]string{3: "route 192.0.2.0/24 via 10.1.0.1"}},
		{"multipath via gateways", netlink.Route{Table: main, Type: unix.RTN_UNICAST, Dst: prefix("2001:db8:7::/48"), MultiPath: []*netlink.NexthopInfo{
			{LinkIndex: 2, Gw: net.ParseIP("2001:db8::1")}, {LinkIndex: 3, Gw: net.ParseIP("2001:db8:1::1")}}},
			map[int]string{2: "route 2001:db8:7::/48 via 2001:db8::1", 3: "route 2001:db8:7::/48 via 2001:db8:1::1"}},
		{"connected", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("10.1.0.0/24")}, map[int]string{3: "route 10.1.0.0/24"}},
		{"private", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("fd00:6::/64")}, map[int]string{3: "route fd00:6::/64"}},
		// A routed CNI's route to one pod, through its veth.
		{"host route on a veth", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 4, Dst: prefix("10.244.1.5/32")}, map[int]string{}},
		{"host route on a veth, IPv6", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 4, Dst: prefix("fd00:244::5/128")}, map[int]string{}},
		// A point-to-point peer (not a veth) is an uplink.
		{"host route elsewhere", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("10.9.0.1/32")}, map[int]string{3: "route 10.9.0.1/32"}},
		{"host route via a gateway on a veth", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 4, Dst: prefix("192.0.2.9/32"), Gw: net.ParseIP("10.0.0.1")},
			map[int]string{4: "route 192.0.2.9/32 via 10.0.0.1"}},
		{"link-local", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 4, Dst: prefix("fe80::/64")}, map[int]string{}},
		{"link-local v4", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("169.254.0.0/16")}, map[int]string{}},
		{"multicast", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("ff00::/8")}, map[int]string{}},
		// A table an ip rule uses (a secondary uplink's own): its routes
		// select as main's do, the table named.
		{"other table", netlink.Route{Table: 100, Type: unix.RTN_UNICAST, LinkIndex: 2}, map[int]string{2: "default route (table 100)"}},
		{"other table via a gateway", netlink.Route{Table: 1000, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("192.0.2.0/24"), Gw: net.ParseIP("10.1.0.1")},
			map[int]string{3: "route 192.0.2.0/24 via 10.1.0.1 (table 1000)"}},
		{"local table", netlink.Route{Table: unix.RT_TABLE_LOCAL, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("10.0.0.0/24")}, map[int]string{}},
		{"unspecified table", netlink.Route{Table: uni, Type: unix.RTN_UNICAST, LinkIndex: 2}, map[int]string{}},
		{"unreachable", netlink.Route{Table: main, Type: unix.RTN_UNREACHABLE, LinkIndex: 1, Dst: prefix("::/0")}, map[int]string{}},
	} {
		got := map[int]string{}
		for i, c := range routeCoverage([]netlink.Route{tc.route}, links) {
			got[i] = c.reason
		}
		if !maps.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
		if routeMatters(tc.route) != (len(tc.want) > 0 || tc.name == "host route on a veth" || tc.name == "host route on a veth, IPv6") {
			t.Errorf("%s: routeMatters %v", tc.name, routeMatters(tc.route))
		}
	}

	// The best reason wins, whatever the order of the routes.
	routes := []netlink.Route{
		{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("10.0.0.0/24")},
		{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("192.0.2.0/24"), Gw: net.ParseIP("10.0.0.9")},
		{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("10.1.0.0/24")},
		{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("198.51.100.0/24"), Gw: net.ParseIP("10.1.0.1")},
		defaultVia(2),
	}
	got := map[int]string{}
	for i, c := range routeCoverage(routes, links) {
		got[i] = c.reason
	}
	if want := map[int]string{2: "default route", 3: "route 198.51.100.0/24 via 10.1.0.1"}; !maps.Equal(got, want) {
		t.Errorf("best reasons %v, want %v", got, want)
	}
}

// TestPodGateways: a device holding an address in one of the node's pod
// CIDRs (a bridge CNI's cni0, the ptp plugin's host-side veth) is a pod
// interface, never selected; a device with a default route always is.
func TestPodGateways(t *testing.T) {
	snap := snapshot{
		links: []netlink.Link{
			link(2, "eth0", 0),
			&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Index: 3, Name: "cni0", EncapType: "ether"}},
			link(4, "veth1", 3),
			link(5, "eth1", 0),
		},
		addrs: []netlink.Addr{
			addr(2, "10.0.0.5/24", global, 0),
			addr(3, "10.244.1.1/24", global, 0),
			addr(5, "10.1.0.5/24", global, 0),
		},
		routes: []netlink.Route{
			defaultVia(2),
			{Table: unix.RT_TABLE_MAIN, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("10.0.0.0/24")},
			{Table: unix.RT_TABLE_MAIN, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("10.244.1.0/24")},
			{Table: unix.RT_TABLE_MAIN, Type: unix.RTN_UNICAST, LinkIndex: 5, Dst: prefix("10.1.0.0/24")},
		},
	}
	reasons := func(rows map[int]*tables.EgressDevice) map[string]string {
		out := map[string]string{}
		for _, d := range rows {
			out[fmt.Sprintf("%s %v", d.Name, d.Selected)] = d.Reason
		}
		return out
	}
	// Without a known pod CIDR the bridge is an uplink like any other.
	rows, _ := desired(snap, nil)
	want := map[string]string{"eth0 true": "default route", "cni0 true": "route 10.244.1.0/24", "veth1 false": "", "eth1 true": "route 10.1.0.0/24"}
	if got := reasons(rows); !maps.Equal(got, want) {
		t.Errorf("no pod CIDR: %v, want %v", got, want)
	}
	// A pod CIDR that covers the uplink's address too (given too wide)
	// does not deselect the device with the default route.
	snap.podPools = []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24"), netip.MustParsePrefix("10.0.0.0/16")}
	rows, _ = desired(snap, nil)
	want = map[string]string{"eth0 true": "default route", "cni0 false": "pod gateway (10.244.1.1 in pod CIDR 10.244.1.0/24)",
		"veth1 false": "", "eth1 true": "route 10.1.0.0/24"}
	if got := reasons(rows); !maps.Equal(got, want) {
		t.Errorf("pod CIDRs: %v, want %v", got, want)
	}
	// --devices decides alone.
	sel, _ := parseSelector([]string{"cni0", "eth+"})
	rows, _ = desired(snap, sel)
	want = map[string]string{"eth0 true": "--devices eth+", "cni0 true": "--devices cni0", "veth1 false": "", "eth1 true": "--devices eth+"}
	if got := reasons(rows); !maps.Equal(got, want) {
		t.Errorf("--devices: %v, want %v", got, want)
	}
}

func TestParseSelector(t *testing.T) {
	for _, good := range [][]string{nil, {"eth0"}, {"eth+"}, {"eth0", "ens+", "wg0"}, {"abcdefghijklmno"}, {"abcdefghijklmno+"}} {
		if _, err := parseSelector(good); err != nil {
			t.Errorf("%q rejected: %v", good, err)
		}
	}
	for _, bad := range []string{"", "+", "eth/0", "eth 0", "eth0\t", "eth:0", "e+th", "abcdefghijklmnop", "abcdefghijklmnop+", "..", "eth\x00"} {
		_, err := parseSelector([]string{"eth0", bad})
		if err == nil {
			t.Errorf("%q accepted", bad)
			continue
		}
		if !strings.Contains(err.Error(), fmt.Sprintf("--devices=%q", bad)) {
			t.Errorf("%q: error does not name the flag and value: %v", bad, err)
		}
	}
	sel, _ := parseSelector([]string{"eth0", "ens+"})
	for name, want := range map[string]string{"eth0": "eth0", "eth01": "", "ens": "ens+", "ens5": "ens+", "eth1": ""} {
		if got := sel.match(name); got != want {
			t.Errorf("match(%q) = %q, want %q", name, got, want)
		}
	}
}

func TestLinkHeaderKind(t *testing.T) {
	gre := func(remote string) netlink.Link {
		return &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{EncapType: "gre"}, Remote: net.ParseIP(remote)}
	}
	for _, c := range []struct {
		name string
		link netlink.Link
		l3   bool
	}{
		{"veth", link(2, "eth0", 0), false},
		{"tun", &netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{EncapType: "none"}}, true},
		{"wireguard", &netlink.Wireguard{LinkAttrs: netlink.LinkAttrs{EncapType: "none"}}, true},
		{"ipip", &netlink.Iptun{LinkAttrs: netlink.LinkAttrs{EncapType: "ipip"}}, true},
		{"sit", &netlink.Sittun{LinkAttrs: netlink.LinkAttrs{EncapType: "sit"}}, true},
		{"ip6tnl", &netlink.Ip6tnl{LinkAttrs: netlink.LinkAttrs{EncapType: "tunnel6"}}, true},
		{"gre point-to-point", gre("192.0.2.1"), true},
		{"gre without remote (NBMA)", gre(""), false},
		{"gre remote 0.0.0.0", gre("0.0.0.0"), false},
		{"infiniband", &netlink.Device{LinkAttrs: netlink.LinkAttrs{EncapType: "infiniband"}}, false},
	} {
		if got := isL3(c.link); got != c.l3 {
			t.Errorf("%s: isL3 = %v, want %v", c.name, got, c.l3)
		}
	}
}
