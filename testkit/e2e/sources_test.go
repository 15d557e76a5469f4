package e2e

import (
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// The masquerade sources by default: every forwarded source but the node's
// own addresses, as the Kubernetes ip-masq-agent (no source match). The
// reference is Linux MASQUERADE with no source match either (-o eth0).

var everySource = []string{"0.0.0.0/0", "::/0"}

// Addresses of a pod outside every CIDR the agent is given, as Calico's
// IPAM blocks, the AWS VPC CNI or Cilium's ENI mode give pods.
var (
	outsidePod4 = netip.MustParseAddr("100.72.9.66")
	outsidePod6 = netip.MustParseAddr("fd00:72::66")
)

// readdressPod gives the pod outsidePod4/6 as the source of its default
// routes, and the node routes to them through pod0.
func readdressPod(t *testing.T, topo *topology.Masquerade) {
	t.Helper()
	eth0, err := topo.Pod.NL.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []struct {
		src, gw, pod netip.Addr
	}{{outsidePod4, nodePodSide4, topology.PodIP4}, {outsidePod6, nodePodSide6, topology.PodIP6}} {
		bits := f.src.BitLen()
		if err := topo.Pod.Addr("eth0", netip.PrefixFrom(f.src, bits).String()); err != nil {
			t.Fatal(err)
		}
		def := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
		if f.src.Is6() {
			def = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		r := &netlink.Route{LinkIndex: eth0.Attrs().Index, Dst: def, Gw: f.gw.AsSlice(), Src: f.src.AsSlice()}
		if err := topo.Pod.NL.RouteReplace(r); err != nil {
			t.Fatalf("pod: default route via %s src %s: %v", f.gw, f.src, err)
		}
		if err := topo.Node.Route(netip.PrefixFrom(f.src, bits).String(), f.pod.String(), "pod0"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPodOutsideEveryCIDRMasqueraded: a pod whose address is in no CIDR the
// agent knows (no --pod-cidr at all, as the upstream DaemonSet's args name
// none) is masqueraded, TCP, UDP and ICMP, both families; the leak watcher
// fails the run if one packet leaves with its address.
func TestPodOutsideEveryCIDRMasqueraded(t *testing.T) {
	underBoth(t, setupSpec{
		config: masqueradeAll, sources: everySource, noPodCIDR: true,
		leakSources: []string{netip.PrefixFrom(outsidePod4, 32).String(), netip.PrefixFrom(outsidePod6, 128).String()},
		beforeStart: readdressPod,
	}, func(t *testing.T, s *scenario) {
		if seen, err := tcpSource(s.topo.Pod, topology.RemoteIP4); err != nil || seen != topology.NodeIP4.String() {
			t.Fatalf("first flow: server saw %q (%v), want %s", seen, err, topology.NodeIP4)
		}
		checkSource(t, s.topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 10)
		checkSource(t, s.topo, s.ext, topology.RemoteIP6, topology.NodeIP6, 10)
		checkSource(t, s.topo, s.ext, topology.ExtIP4, topology.NodeIP4, 5)
		if s.agent != nil {
			// status says which sources are masqueraded
			out, err := exec.Command(agentBin, "status", "--shell-sock-path="+filepath.Join(s.agent.dir, "shell.sock")).CombinedOutput()
			if err != nil || !strings.Contains(string(out), "Sources:    masquerading every forwarded source") {
				t.Errorf("status (%v) does not say every source is masqueraded:\n%s", err, out)
			}
		}
	})
}

// TestTunnelClientsWithoutRule: clients of a tunnel on the node (wg0)
// leaving through eth0 are masqueraded with no masqueradeRules entry, as
// under upstream; the node's own traffic keeps its address.
func TestTunnelClientsWithoutRule(t *testing.T) {
	underBoth(t, setupSpec{client: true, config: masqueradeAll, sources: everySource}, func(t *testing.T, s *scenario) {
		clientSources(t, s.topo, s.ext, topology.ExtIP4, topology.NodeIP4, 10)
		clientSources(t, s.topo, s.ext, topology.ExtIP6, topology.NodeIP6, 10)
		// The pod too, and the node's own flows leave as they are.
		checkSource(t, s.topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 2)
		if seen, err := tcpSource(s.topo.Node, topology.RemoteIP4); err != nil || seen != topology.NodeIP4.String() {
			t.Fatalf("node's own flow: %q %v", seen, err)
		}
	})
}
