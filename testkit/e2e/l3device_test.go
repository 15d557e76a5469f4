package e2e

import (
	"testing"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// logL3Kind says which L3 device the L3 tests run on. WireGuard needs keys
// and peers configured over generic netlink, which this repository has no
// client for, so the tests always use tun; the log says whether the kernel
// would have had WireGuard.
func logL3Kind(t *testing.T) {
	n, err := topology.NewNetns("probe")
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if err := topology.WireGuardAvailable(n); err != nil {
		t.Logf("L3 device: tun (IFF_TUN|IFF_NO_PI, forwarded in Go); WireGuard is not available on this kernel: %v", err)
	} else {
		t.Logf("L3 device: tun (IFF_TUN|IFF_NO_PI, forwarded in Go); this kernel has WireGuard, but the tests do not configure wg peers")
	}
}

// TestL3Uplink: the node's uplink eth0 is an L3 device (tun): no --devices,
// so auto-detection must pick it for its default route; pod TCP, UDP and
// ping, IPv4 and IPv6, reach a remote that has no route back and that sees
// the node's address.
func TestL3Uplink(t *testing.T) {
	logL3Kind(t)
	spec := setupSpec{opts: topology.Options{L3Uplink: true}, config: masqueradeAll, sources: podSources}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		checkSource(t, s.topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 8)
		checkSource(t, s.topo, s.ext, topology.RemoteIP6, topology.NodeIP6, 8)
		checkSource(t, s.topo, s.ext, topology.ExtIP4, topology.NodeIP4, 2)
		checkSource(t, s.topo, s.ext, topology.ExtIP6, topology.NodeIP6, 2)
		if a := s.agent; a != nil {
			for _, hook := range []string{"egress", "ingress"} {
				if got, want := a.attachedProgram("eth0", hook), "ipmasq_"+hook+"_l3"; got != want {
					t.Errorf("eth0 %s runs %q, want the L3 variant %q", hook, got, want)
				}
			}
			if n := a.counter(bpf.CounterMasqueraded); n == 0 {
				t.Error("no packet counted as masqueraded")
			}
		}
	})
}

// TestL3UplinkClsact: the same with the programs attached as clsact
// filters (kernels without tcx).
func TestL3UplinkClsact(t *testing.T) {
	spec := setupSpec{opts: topology.Options{L3Uplink: true}, config: masqueradeAll, sources: podSources,
		agentArgs: []string{"--tc-attach-mode=clsact"}}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		checkSource(t, s.topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 4)
		checkSource(t, s.topo, s.ext, topology.RemoteIP6, topology.NodeIP6, 4)
		if a := s.agent; a != nil && a.counter(bpf.CounterMasqueraded) == 0 {
			t.Error("no packet counted as masqueraded")
		}
	})
}

// TestL3TunnelClients: the Calico seed (a masquerade rule for the clients
// behind wg0, leaving through eth0) with wg0 an L3 device: 20 pings, TCP
// and UDP flows, IPv4 and IPv6, all answered, the remote sees the node.
func TestL3TunnelClients(t *testing.T) {
	logL3Kind(t)
	spec := setupSpec{
		opts:    topology.Options{L3Client: true},
		client:  true,
		config:  "nonMasqueradeCIDRs: []\n" + wgRule,
		sources: []string{topology.ClientCIDR4, topology.ClientCIDR6},
	}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		clientSources(t, s.topo, s.ext, topology.ExtIP4, topology.NodeIP4, 20)
		clientSources(t, s.topo, s.ext, topology.ExtIP6, topology.NodeIP6, 20)
		if a := s.agent; a != nil && a.counter(bpf.CounterNATNewByRule) == 0 {
			t.Error("no NAT pair counted for the rule's sources")
		}
	})
}
