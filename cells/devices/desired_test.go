package devices

import (
	"fmt"
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
	snap.defaultRoutes = map[int]struct{}{1: {}}
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
		defaults map[int]struct{}
		want     []string
		ports    []portMatch
	}{
		{name: "default routes", defaults: map[int]struct{}{3: {}, 8: {}}, want: []string{"eth1", "eth3"}},
		{name: "no default route", defaults: map[int]struct{}{}, want: nil},
		{name: "default route on a bridge port", defaults: map[int]struct{}{5: {}, 6: {}}, want: []string{"br0"}},
		{name: "names", patterns: []string{"eth0", "ens5"}, want: []string{"ens5", "eth0"}},
		{name: "prefix", patterns: []string{"eth+"}, want: []string{"eth0", "eth1", "eth3"},
			ports: []portMatch{{name: "eth2", master: "br0"}}},
		{name: "name and prefix", patterns: []string{"br0", "en+"}, want: []string{"br0", "ens5"}},
		{name: "pattern ignores default routes", patterns: []string{"ens5"}, defaults: map[int]struct{}{2: {}},
			want: []string{"ens5"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sel, err := parseSelector(tc.patterns)
			if err != nil {
				t.Fatal(err)
			}
			rows, ports := desired(snapshot{links: links, defaultRoutes: tc.defaults}, sel)
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

func TestDefaultRoutes(t *testing.T) {
	prefix := func(s string) *net.IPNet {
		_, n, err := net.ParseCIDR(s)
		if err != nil {
			panic(err)
		}
		return n
	}
	main, uni := unix.RT_TABLE_MAIN, unix.RT_TABLE_UNSPEC
	for _, tc := range []struct {
		name  string
		route netlink.Route
		want  []int
	}{
		{"nil destination", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2}, []int{2}},
		{"0.0.0.0/0", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("0.0.0.0/0")}, []int{2}},
		{"::/0", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 3, Dst: prefix("::/0")}, []int{3}},
		{"multipath", netlink.Route{Table: main, Type: unix.RTN_UNICAST, MultiPath: []*netlink.NexthopInfo{
			{LinkIndex: 2}, {LinkIndex: 4}}}, []int{2, 4}},
		{"not default", netlink.Route{Table: main, Type: unix.RTN_UNICAST, LinkIndex: 2, Dst: prefix("10.0.0.0/8")}, nil},
		{"other table", netlink.Route{Table: 100, Type: unix.RTN_UNICAST, LinkIndex: 2}, nil},
		{"unspecified table", netlink.Route{Table: uni, Type: unix.RTN_UNICAST, LinkIndex: 2}, nil},
		{"unreachable", netlink.Route{Table: main, Type: unix.RTN_UNREACHABLE, LinkIndex: 1, Dst: prefix("::/0")}, nil},
	} {
		links := map[int]struct{}{}
		if isDefaultRoute(tc.route) {
			addRouteLinks(links, tc.route)
		}
		var got []int
		for i := range links {
			got = append(got, i)
		}
		slices.Sort(got)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: links %v, want %v", tc.name, got, tc.want)
		}
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
	for name, want := range map[string]bool{"eth0": true, "eth01": false, "ens": true, "ens5": true, "eth1": false} {
		if sel.matches(name) != want {
			t.Errorf("matches(%q) = %v, want %v", name, !want, want)
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
