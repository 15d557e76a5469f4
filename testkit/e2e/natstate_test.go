package e2e

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// NAT state under pressure (issue #22): what conntrack promises an operator
// when its state is lost, full or changed under running flows. Each
// scenario runs under Linux MASQUERADE first, then ipmasq, with the leak
// watcher on ext's link.

// echoOnce writes msg on c and reads its echo back.
func echoOnce(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatalf("write %q: %v", msg, err)
	}
	buf := make([]byte, len(msg))
	if _, err := readFull(c, buf); err != nil || string(buf) != msg {
		t.Fatalf("echo of %q: got %q, %v", msg, buf, err)
	}
}

// dropNATState forgets every translation the masquerader holds, as a full
// table's eviction, a collector race or a node migrated from iptables
// leaves a running flow: ipmasq's NAT maps are emptied, Linux's conntrack
// table is flushed.
func dropNATState(t *testing.T, s *scenario) {
	t.Helper()
	if s.agent == nil {
		if err := s.topo.Node.NL.ConntrackTableFlush(netlink.ConntrackTable); err != nil {
			t.Fatalf("flush the node's conntrack table: %v", err)
		}
		return
	}
	for _, name := range []string{bpf.MapNATV4, bpf.MapNATV6} {
		m, err := ebpf.LoadPinnedMap(filepath.Join(s.agent.bpfRoot, "ipmasq", name), nil)
		if err != nil {
			t.Fatal(err)
		}
		var keys [][]byte
		var k, v []byte
		it := m.Iterate()
		for it.Next(&k, &v) {
			keys = append(keys, append([]byte(nil), k...))
		}
		for _, k := range keys {
			if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				t.Fatalf("delete from %s: %v", name, err)
			}
		}
		m.Close()
	}
}

// TestMidStreamWithoutPair: a TCP connection from the pod loses its NAT
// state while it is open. Its next segment (data, mid-stream) has no pair:
// Linux picks the connection up (nf_conntrack_tcp_loose=1, the default)
// and masquerades it, keeping the source port, which is free, so the
// connection carries on; ipmasq must do the same (or drop the segment),
// never send it with the pod's address (the leak watcher fails the run).
func TestMidStreamWithoutPair(t *testing.T) {
	underBoth(t, masqueradePods(), func(t *testing.T, s *scenario) {
		for _, c := range []struct{ remote, node netip.Addr }{
			{topology.RemoteIP4, topology.NodeIP4}, {topology.RemoteIP6, topology.NodeIP6},
		} {
			conn, seen, err := dialTCP(s.topo.Pod, c.remote)
			if err != nil || seen != c.node.String() {
				t.Fatalf("TCP to %s: seen as %q, %v", c.remote, seen, err)
			}
			echoOnce(t, conn, "before\n")
			dropNATState(t, s)
			for i := range 3 {
				echoOnce(t, conn, fmt.Sprintf("after the state was lost, %d\n", i))
			}
			conn.Close()
			// New flows are masqueraded as ever.
			if seen, err := tcpSource(s.topo.Pod, c.remote); err != nil || seen != c.node.String() {
				t.Fatalf("new TCP flow to %s: seen as %q, %v", c.remote, seen, err)
			}
		}
		if a := s.agent; a != nil && a.counter(bpf.CounterSkipNotFlowStart) != 0 {
			t.Errorf("segments passed untranslated:\n%s", a.counters())
		}
	})
}

// TestRemovedSourceKeepsFlows: the masquerade rule for the tunnel clients
// is removed while a client's TCP connection runs. Linux keeps the
// connection's NAT (conntrack decided it once) and so must ipmasq: the
// connection carries on from the node's address, none of its segments
// leaves with the client's address.
func TestRemovedSourceKeepsFlows(t *testing.T) {
	spec := setupSpec{
		client:  true,
		config:  "nonMasqueradeCIDRs: []\n" + wgRule,
		sources: []string{topology.ClientCIDR4, topology.ClientCIDR6},
	}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		var conns []net.Conn
		for _, c := range []struct{ remote, node netip.Addr }{
			{topology.RemoteIP4, topology.NodeIP4}, {topology.RemoteIP6, topology.NodeIP6},
		} {
			conn, seen, err := dialTCP(s.topo.Client, c.remote)
			if err != nil || seen != c.node.String() {
				t.Fatalf("client TCP to %s: seen as %q, %v", c.remote, seen, err)
			}
			defer conn.Close()
			echoOnce(t, conn, "before\n")
			conns = append(conns, conn)
		}
		removeClientRule(t, s, spec.sources)
		for i := range 3 {
			for _, conn := range conns {
				echoOnce(t, conn, fmt.Sprintf("after the rule was removed, %d\n", i))
			}
		}
	})
}

// removeClientRule stops masquerading the tunnel clients (sources): ipmasq's
// rule goes from its config, the reference's MASQUERADE rules from its
// chain. The reference keeps another rule in its chain, as an operator's
// chain has: removing the chain's last rule under iptables-nft stopped
// translating the established flows here.
func removeClientRule(t *testing.T, s *scenario, sources []string) {
	t.Helper()
	if a := s.agent; a != nil {
		a.writeConfig("nonMasqueradeCIDRs: []\n")
		a.waitRuleSources(0)
		return
	}
	for _, v6 := range []bool{false, true} {
		other := "198.18.0.0/15"
		if v6 {
			other = "2001:2::/48"
		}
		if err := s.topo.Node.Iptables(v6, "-t", "nat", "-A", "POSTROUTING", "-s", other, "-o", "eth0", "-j", "MASQUERADE"); err != nil {
			t.Fatal(err)
		}
	}
	for _, src := range sources {
		v6 := netip.MustParsePrefix(src).Addr().Is6()
		if err := s.topo.Node.Iptables(v6, "-t", "nat", "-D", "POSTROUTING", "-s", src, "-o", "eth0", "-j", "MASQUERADE"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestFullTableSparesEstablished: a pod holds an idle, established TCP
// connection per family while the node's pods send a burst of DNS-like
// queries from fresh sockets, several times the NAT table's capacity
// (--nat-max-entries=64: 32 flows per family), every one answered. Like
// conntrack's early drop, table pressure may end only flows nobody
// answered for long (a query and its answer), never the established
// connection: it still answers afterwards, from the node's address, and no
// pod address reaches the wire. Then the table is filled with established
// connections: a new flow is refused (counted in drop-nat-table-full), and
// every established connection still answers. Linux's conntrack (262 144
// entries, not settable per namespace) is not full: the reference shows
// the traffic itself works on this topology.
func TestFullTableSparesEstablished(t *testing.T) {
	const natMax, queries = 64, 300
	underBoth(t, masqueradePods(fmt.Sprintf("--nat-max-entries=%d", natMax)), func(t *testing.T, s *scenario) {
		var idle []net.Conn
		defer func() {
			for _, c := range idle {
				c.Close()
			}
		}()
		for _, c := range []struct{ remote, node netip.Addr }{
			{topology.RemoteIP4, topology.NodeIP4}, {topology.RemoteIP6, topology.NodeIP6},
		} {
			conn, seen, err := dialTCP(s.topo.Pod, c.remote)
			if err != nil || seen != c.node.String() {
				t.Fatalf("idle connection to %s: seen as %q, %v", c.remote, seen, err)
			}
			echoOnce(t, conn, "before the burst\n")
			idle = append(idle, conn)
		}
		for i := range queries {
			remote, node := topology.RemoteIP4, topology.NodeIP4
			if i%2 == 1 {
				remote, node = topology.RemoteIP6, topology.NodeIP6
			}
			if seen, err := udpSource(s.topo.Pod, remote); err != nil || seen != node.String() {
				msg := fmt.Sprintf("query %d of %d to %s: seen as %q, %v", i+1, queries, remote, seen, err)
				if s.agent != nil {
					msg += "\n" + s.agent.counters()
				}
				t.Fatal(msg)
			}
		}
		for i, conn := range idle {
			echoOnce(t, conn, fmt.Sprintf("idle connection %d after %d queries\n", i, queries))
		}

		// Fill the IPv4 table with established connections (and then some:
		// under ipmasq the last ones are refused).
		refused := 0
		for i := range natMax / 2 {
			conn, seen, err := dialTCP(s.topo.Pod, topology.RemoteIP4)
			if err != nil {
				refused++
				continue
			}
			if seen != topology.NodeIP4.String() {
				t.Fatalf("connection %d: seen as %q", i, seen)
			}
			idle = append(idle, conn)
		}
		for i, conn := range idle {
			echoOnce(t, conn, fmt.Sprintf("established connection %d with the table full\n", i))
		}
		if a := s.agent; a != nil {
			if refused == 0 {
				t.Errorf("%d connections fit a table of %d entries per family", natMax/2+1, natMax)
			}
			if full := a.natFullCount(); full == 0 {
				t.Errorf("refused flows not counted (drop-nat-table-full 0):\n%s", a.counters())
			}
		}
		t.Logf("%d new connections refused with the table full", refused)
	})
}

// TestPodPortUnreachableToInboundProbe: ext (which routes to the pods)
// sends a UDP probe to a pod port nothing listens on; the pod's ICMP port
// unreachable leaves with the pod's own address, as Linux passes it (the
// probe's flow is ext's, not masqueraded), and ext's socket sees
// ECONNREFUSED.
func TestPodPortUnreachableToInboundProbe(t *testing.T) {
	spec := masqueradePods()
	spec.podAddressesOnWire = true // the pod answers ext from its own address
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		if err := s.topo.RouteBack(); err != nil {
			t.Fatal(err)
		}
		for _, pod := range []netip.Addr{topology.PodIP4, topology.PodIP6} {
			var c net.Conn
			if err := s.topo.Ext.Do(func() (err error) {
				c, err = net.Dial("udp", netip.AddrPortFrom(pod, refusedPort).String())
				return err
			}); err != nil {
				t.Fatal(err)
			}
			var got error
			for try := 0; try < 3; try++ {
				c.SetDeadline(time.Now().Add(time.Second))
				c.Write([]byte("probe"))
				_, got = c.Read(make([]byte, 16))
				if errors.Is(got, syscall.ECONNREFUSED) {
					break
				}
			}
			c.Close()
			if !errors.Is(got, syscall.ECONNREFUSED) {
				msg := fmt.Sprintf("UDP probe to %s:%d: %v, want ECONNREFUSED (the pod's port unreachable)", pod, refusedPort, got)
				if s.agent != nil {
					msg += "\n" + s.agent.counters()
				}
				t.Error(msg)
			}
		}
	})
}
