package e2e

import (
	"net/netip"
	"testing"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// TestRandomFully: upstream's --random-fully (its default) means
// MASQUERADE --random-fully: every masqueraded flow gets a random source
// port of 1024-65535, its own port not kept even when free. Under the
// reference (-j MASQUERADE --random-fully) and under ipmasq with
// --random-fully, 20 TCP connections per family and 20 UDP flows from
// fixed pod ports leave from other ports, spread over the space; every
// connection carries data. (Without it, TestSourcePortKept: the ports are
// kept.)
func TestRandomFully(t *testing.T) {
	var (
		a               *agent
		referenceFailed bool
	)
	reference := masquerader{name: "MASQUERADE --random-fully", start: func(t *testing.T, topo *topology.Masquerade) {
		for _, r := range []struct {
			v6  bool
			src string
		}{{false, topology.PodCIDR4}, {true, topology.PodCIDR6}} {
			if err := topo.Node.Iptables(r.v6, "-t", "nat", "-A", "POSTROUTING", "-s", r.src, "-o", "eth0", "-j", "MASQUERADE", "--random-fully"); err != nil {
				t.Fatal(err)
			}
		}
		a = nil
	}}
	ipmasq := masquerader{name: "ipmasq", start: func(t *testing.T, topo *topology.Masquerade) {
		if referenceFailed {
			t.Fatal("the reference (Linux MASQUERADE) failed on this topology: the scenario proves nothing")
		}
		a = newAgent(t, topo.Node, masqueradeAll)
		a.args = []string{"--random-fully"}
		a.start()
	}}
	runEach(t, []masquerader{reference, ipmasq}, func(t *testing.T, topo *topology.Masquerade) {
		if a == nil {
			t.Cleanup(func() { referenceFailed = t.Failed() })
		}
		serveWhoAmI(t, topo.Ext)
		leaks := watchLeaks(t, topo.Ext, "eth0", topology.PodCIDR4, topology.PodCIDR6)
		for _, c := range []struct {
			name      string
			pod, node netip.Addr
			remote    netip.Addr
			udp       bool
		}{
			{"TCP", topology.PodIP4, topology.NodeIP4, topology.RemoteIP4, false},
			{"IPv6 TCP", topology.PodIP6, topology.NodeIP6, topology.RemoteIP6, false},
			{"UDP", topology.PodIP4, topology.NodeIP4, topology.RemoteIP4, true},
		} {
			dst := netip.AddrPortFrom(c.remote, whoAmIPort)
			own, ports := 0, map[uint16]bool{}
			for i := range 20 {
				src := netip.AddrPortFrom(c.pod, uint16(45000+i))
				var seen netip.AddrPort
				if c.udp {
					_, seen = udpFrom(t, topo.Pod, src, dst)
				} else {
					conn, r, s := tcpFrom(t, topo.Pod, src, dst)
					stillEchoes(t, c.name+" connection", conn, r)
					seen = s
				}
				if seen.Addr() != c.node || seen.Port() < 1024 {
					t.Fatalf("%s from %s: server saw %s, want %s and a port of 1024-65535", c.name, src, seen, c.node)
				}
				if seen.Port() == src.Port() {
					own++
				}
				ports[seen.Port()] = true
			}
			// 20 draws over 64 512 ports: two on their own port, p < 1e-7.
			if own > 1 || len(ports) < 18 {
				t.Errorf("%s: %d of 20 flows kept their own port, %d distinct ports; want random ports", c.name, own, len(ports))
			}
		}
		leaks.check(t)
	})
}
