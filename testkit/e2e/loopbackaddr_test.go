package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// nodeLoopbackIP4 is the node's address on lo in TestSNATAddressOnLoopback.
var nodeLoopbackIP4 = netip.MustParseAddr("10.0.9.9")

// TestSNATAddressOnLoopback: the node's IPv4 address is on lo, as on BGP
// and anycast nodes (the uplink has no IPv4 address of its own; the
// default route is onlink with src 10.0.9.9). MASQUERADE picks it (the
// uplink has none, so the kernel takes the node's first global address,
// lo's) and so does ipmasq (the route's src). A masqueraded TCP connection
// keeps working across many collector rounds (--nat-gc-interval=200ms):
// the collector must count an address on lo as a node address, or it
// deletes the connection's pair each round and its next segment leaves
// with the pod's address (the leak watcher fails the run).
func TestSNATAddressOnLoopback(t *testing.T) {
	spec := masqueradePods("--nat-gc-interval=200ms")
	spec.beforeStart = func(t *testing.T, topo *topology.Masquerade) {
		if err := topo.Node.Addr("lo", nodeLoopbackIP4.String()+"/32"); err != nil {
			t.Fatal(err)
		}
		eth0, err := topo.Node.NL.LinkByName("eth0")
		if err != nil {
			t.Fatal(err)
		}
		addrs, err := topo.Node.NL.AddrList(eth0, netlink.FAMILY_V4)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range addrs {
			if err := topo.Node.NL.AddrDel(eth0, &a); err != nil {
				t.Fatal(err)
			}
		}
		if err := topo.Node.NL.RouteReplace(&netlink.Route{
			LinkIndex: eth0.Attrs().Index, Gw: net.ParseIP(topology.ExtIP4.String()), Flags: int(netlink.FLAG_ONLINK),
			Src: nodeLoopbackIP4.AsSlice(), Dst: &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)},
		}); err != nil {
			t.Fatalf("node default route with src %s: %v", nodeLoopbackIP4, err)
		}
		if err := topo.Ext.NL.RouteAdd(&netlink.Route{LinkIndex: extLink(t, topo), Scope: netlink.SCOPE_LINK,
			Dst: &net.IPNet{IP: nodeLoopbackIP4.AsSlice(), Mask: net.CIDRMask(32, 32)}}); err != nil {
			t.Fatalf("ext route to %s: %v", nodeLoopbackIP4, err)
		}
	}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		conn, seen, err := dialTCP(s.topo.Pod, topology.RemoteIP4)
		if err != nil || seen != nodeLoopbackIP4.String() {
			t.Fatalf("TCP from the pod: server saw %q (%v), want the node's address on lo %s", seen, err, nodeLoopbackIP4)
		}
		defer conn.Close()
		for round := range 6 {
			time.Sleep(500 * time.Millisecond) // a few collector rounds
			echoOnce(t, conn, fmt.Sprintf("after %d ms\n", (round+1)*500))
		}
		if seen, err := udpSource(s.topo.Pod, topology.RemoteIP4); err != nil || seen != nodeLoopbackIP4.String() {
			t.Fatalf("UDP from the pod: server saw %q (%v), want %s", seen, err, nodeLoopbackIP4)
		}
	})
}

// extLink is the index of ext's eth0.
func extLink(t *testing.T, topo *topology.Masquerade) int {
	t.Helper()
	l, err := topo.Ext.NL.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	return l.Attrs().Index
}
