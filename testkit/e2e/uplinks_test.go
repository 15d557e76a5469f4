package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// The second uplink of TestSecondUplink: the node's eth1 leads to the
// namespace "uplink2", which holds the far side's addresses on its
// loopback; the node routes them through eth1 while its default route
// stays on eth0.
var (
	uplink2Node4, uplink2Node6 = netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("2001:db8:1::5")
	uplink2Far4, uplink2Far6   = netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8:2::10")
)

// addSecondUplink gives the node eth1 (10.1.0.5, 2001:db8:1::5) to a new
// namespace uplink2 (10.1.0.1, 2001:db8:1::1, and 192.0.2.10,
// 2001:db8:2::10 on its loopback) and routes 192.0.2.0/24 and
// 2001:db8:2::/64 through it. uplink2 has no route to the pod CIDRs: a
// pod's traffic is answered only when it leaves masqueraded.
func addSecondUplink(t *testing.T, topo *topology.Masquerade) *topology.Netns {
	t.Helper()
	far, err := topology.NewNetns("uplink2")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(far.Close)
	for _, step := range []func() error{
		func() error { return topology.Veth(topo.Node, "eth1", far, "eth0", 0) },
		func() error { return topo.Node.Addr("eth1", "10.1.0.5/24") },
		func() error { return topo.Node.Addr("eth1", "2001:db8:1::5/64") },
		func() error { return far.Addr("eth0", "10.1.0.1/24") },
		func() error { return far.Addr("eth0", "2001:db8:1::1/64") },
		func() error { return far.Addr("lo", "192.0.2.10/32") },
		func() error { return far.Addr("lo", "2001:db8:2::10/128") },
		func() error { return topo.Node.Route("192.0.2.0/24", "10.1.0.1", "eth1") },
		func() error { return topo.Node.Route("2001:db8:2::/64", "2001:db8:1::1", "eth1") },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	return far
}

// policyTable is the routing table of TestPolicyRoutedUplink's eth1.
const policyTable = 100

// addPolicyRoutedUplink is addSecondUplink with every route of eth1 in a
// table of its own (policyTable), which an ip rule gives the pods'
// sources, as AWS's VPC CNI routes a secondary ENI: eth1 has no route in
// the main table at all.
func addPolicyRoutedUplink(t *testing.T, topo *topology.Masquerade) *topology.Netns {
	t.Helper()
	far := addSecondUplink(t, topo)
	nl := topo.Node.NL
	eth1, err := nl.LinkByName("eth1")
	if err != nil {
		t.Fatal(err)
	}
	routes, err := nl.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{LinkIndex: eth1.Attrs().Index, Table: unix.RT_TABLE_MAIN},
		netlink.RT_FILTER_OIF|netlink.RT_FILTER_TABLE)
	if err != nil {
		t.Fatal(err)
	}
	// Connected routes first (the gateways' routes need them), then the
	// rest, each moved from main to the table.
	var moved []netlink.Route
	for _, r := range routes {
		if r.Dst != nil && r.Dst.IP.IsLinkLocalUnicast() {
			continue
		}
		if r.Gw == nil {
			moved = append([]netlink.Route{r}, moved...)
		} else {
			moved = append(moved, r)
		}
	}
	for _, r := range moved {
		if err := nl.RouteDel(&r); err != nil {
			t.Fatalf("delete main's %s: %v", r, err)
		}
	}
	for _, r := range moved {
		r.Table = policyTable
		if err := nl.RouteAdd(&r); err != nil {
			t.Fatalf("add %s to table %d: %v", r, policyTable, err)
		}
	}
	if len(moved) != 4 {
		t.Fatalf("moved %d of eth1's routes to table %d, want 4 (two connected, two via 10.1.0.1 and 2001:db8:1::1): %v", len(moved), policyTable, moved)
	}
	for _, src := range podSources {
		p := netip.MustParsePrefix(src)
		rule := netlink.NewRule()
		rule.Family = unix.AF_INET
		if p.Addr().Is6() {
			rule.Family = unix.AF_INET6
		}
		rule.Src = &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
		rule.Table = policyTable
		rule.Priority = 1000
		if err := nl.RuleAdd(rule); err != nil {
			t.Fatalf("ip rule from %s lookup %d: %v", src, policyTable, err)
		}
	}
	return far
}

// TestSecondUplink: with the default route on eth0 and a route to
// 192.0.2.0/24 (2001:db8:2::/64) through eth1, a pod's connections to the
// far side of eth1 leave masqueraded to eth1's address, as the upstream
// agent's POSTROUTING rule (no -o) masquerades on every device. The
// reference is Linux MASQUERADE without -o. ipmasq selects eth1 for its
// route, and not pod0 (the pods' gateway, an address in --pod-cidr);
// status says why.
func TestSecondUplink(t *testing.T) {
	secondUplink(t, addSecondUplink,
		`eth1 \(10\.1\.0\.5, 2001:db8:1::5; route (192\.0\.2\.0/24 via 10\.1\.0\.1|2001:db8:2::/64 via 2001:db8:1::1)\)`)
}

// TestPolicyRoutedUplink is TestSecondUplink with eth1's routes only in a
// table of their own that an ip rule gives the pods (policy routing, as a
// secondary ENI's): eth1 is covered all the same, status naming the table.
func TestPolicyRoutedUplink(t *testing.T) {
	secondUplink(t, addPolicyRoutedUplink,
		fmt.Sprintf(`eth1 \(10\.1\.0\.5, 2001:db8:1::5; route (192\.0\.2\.0/24 via 10\.1\.0\.1|2001:db8:2::/64 via 2001:db8:1::1) \(table %d\)\)`, policyTable))
}

// secondUplink runs TestSecondUplink's scenario on the node's second uplink
// that add makes, status's line for it matching eth1Status.
func secondUplink(t *testing.T, add func(*testing.T, *topology.Masquerade) *topology.Netns, eth1Status string) {
	referenceFailed := false
	// uplink2 is the far side of the current run's eth1.
	var uplink2 *topology.Netns
	reference := masquerader{name: "MASQUERADE", start: func(t *testing.T, topo *topology.Masquerade) {
		uplink2 = add(t, topo)
		for _, src := range podSources {
			if err := topo.Node.Iptables(netip.MustParsePrefix(src).Addr().Is6(), "-t", "nat", "-A", "POSTROUTING", "-s", src, "-j", "MASQUERADE"); err != nil {
				t.Fatal(err)
			}
		}
	}}
	var a *agent
	ipmasq := masquerader{name: "ipmasq", start: func(t *testing.T, topo *topology.Masquerade) {
		if referenceFailed {
			t.Fatal("the reference (Linux MASQUERADE) failed on this topology: the scenario proves nothing")
		}
		uplink2 = add(t, topo)
		// The upstream defaults: 192.0.2.0/24 and 2001:db8:2::/64 are
		// masqueraded.
		a = newAgent(t, topo.Node, "")
		a.start()
		a.waitAttached("eth1")
	}}
	runEach(t, []masquerader{reference, ipmasq}, func(t *testing.T, topo *topology.Masquerade) {
		if a == nil {
			t.Cleanup(func() { referenceFailed = t.Failed() })
		}
		startServers(t, uplink2, uplink2Far4, uplink2Far6)
		leaks := watchLeaks(t, uplink2, "eth0", podSources...)

		for _, c := range []struct {
			dst, want netip.Addr
		}{{uplink2Far4, uplink2Node4}, {uplink2Far6, uplink2Node6}} {
			if seen, err := tcpSource(topo.Pod, c.dst); err != nil || seen != c.want.String() {
				t.Errorf("TCP from the pod to %s through eth1: seen from %q (%v), want eth1's %s", c.dst, seen, err, c.want)
			}
			if seen, err := udpSource(topo.Pod, c.dst); err != nil || seen != c.want.String() {
				t.Errorf("UDP from the pod to %s through eth1: seen from %q (%v), want eth1's %s", c.dst, seen, err, c.want)
			}
		}
		leaks.check(t)

		if a == nil {
			return
		}
		status := a.status(t)
		devices := ""
		for _, l := range strings.Split(status, "\n") {
			if strings.HasPrefix(l, "Devices:") {
				devices = l
			}
		}
		if !regexp.MustCompile(`eth0 \(10\.0\.0\.5, 2001:db8::5; default route\)`).MatchString(devices) ||
			!regexp.MustCompile(eth1Status).MatchString(devices) ||
			strings.Contains(devices, "pod0") {
			t.Errorf("status: %q, want eth0 for its default route and eth1 for its route, not pod0\n%s", devices, status)
		}
		if !strings.Contains(status, "Readiness:  ready\n") {
			t.Errorf("status does not say ready:\n%s", status)
		}
	})
}
