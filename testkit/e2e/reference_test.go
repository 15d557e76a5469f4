package e2e

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// A scenario runs twice on fresh topologies: first with Linux MASQUERADE
// in the node (iptables-nft, the reference), then with ipmasq. The
// reference must pass, or the scenario proves nothing and the test fails
// before ipmasq runs.

// scenario is one run of a test under one masquerader.
type scenario struct {
	topo *topology.Masquerade
	ext  *servers
	// agent is the ipmasq agent; nil under Linux MASQUERADE.
	agent *agent
	// leaks is the watcher on ext's link (nil with podAddressesOnWire):
	// a scenario allows the flows that legitimately keep a pod address.
	leaks *leakWatch
}

// setupSpec describes the node of a scenario.
type setupSpec struct {
	opts topology.Options
	// client adds the tunnel client behind wg0.
	client bool
	// config is ipmasq's; sources are the reference's MASQUERADE sources
	// (-o eth0).
	config  string
	sources []string
	// agentArgs are extra ipmasq-agent flags.
	agentArgs []string
	// noPodCIDR starts ipmasq with no --pod-cidr.
	noPodCIDR bool
	// prepareAgent runs on the agent before it starts.
	prepareAgent func(t *testing.T, a *agent)
	// leakSources are more sources the leak watcher looks for.
	leakSources []string
	// podAddressesOnWire: the scenario sends pod addresses to ext on
	// purpose (answers to flows ext opened), so there is no leak watcher.
	podAddressesOnWire bool
	// beforeStart runs on the topology before the masquerader starts.
	beforeStart func(t *testing.T, topo *topology.Masquerade)
}

var podSources = []string{topology.PodCIDR4, topology.PodCIDR6}

// underBoth runs fn under Linux MASQUERADE and then under ipmasq
// (runEachWith). If the reference fails, the ipmasq run fails at
// once: the scenario proves nothing. Under both, a watcher on ext's eth0
// fails the run if any packet arrives with a pod or tunnel client address:
// nothing from a masquerade source to a masqueraded destination may leave
// untranslated.
func underBoth(t *testing.T, spec setupSpec, fn func(t *testing.T, s *scenario)) {
	t.Helper()
	var a *agent
	referenceFailed := false
	ipmasq := masquerader{name: "ipmasq", start: func(t *testing.T, topo *topology.Masquerade) {
		if referenceFailed {
			t.Fatal("the reference (Linux MASQUERADE) failed on this topology: the scenario proves nothing")
		}
		a = newAgent(t, topo.Node, spec.config)
		a.args = spec.agentArgs
		a.noPodCIDR = spec.noPodCIDR
		if spec.prepareAgent != nil {
			spec.prepareAgent(t, a)
		}
		a.start()
	}}
	ms := []masquerader{linuxMasqueradeOf(spec.sources...), ipmasq}
	if spec.beforeStart != nil {
		for i, m := range ms {
			ms[i].start = func(t *testing.T, topo *topology.Masquerade) {
				spec.beforeStart(t, topo)
				m.start(t, topo)
			}
		}
	}
	runEachWith(t, spec.opts, ms, func(t *testing.T, topo *topology.Masquerade) {
		s := &scenario{topo: topo, agent: a}
		if a == nil {
			t.Cleanup(func() { referenceFailed = t.Failed() })
		}
		if spec.client {
			if _, err := topo.AddTunnelClient(); err != nil {
				t.Fatal(err)
			}
			if a != nil {
				// wg0's subnet is a route the node forwards through: the
				// programs come to it too. A flow in flight as they attach
				// has no inbound record for its replies: start after.
				a.waitAttached("wg0")
			}
		}
		s.ext = startServers(t, topo.Ext, topology.ExtIP4, topology.ExtIP6, topology.RemoteIP4, topology.RemoteIP6)
		if spec.podAddressesOnWire {
			fn(t, s)
			return
		}
		leaks := watchLeaks(t, topo.Ext, "eth0", append([]string{topology.PodCIDR4, topology.PodCIDR6, topology.ClientCIDR4, topology.ClientCIDR6}, spec.leakSources...)...)
		s.leaks = leaks
		fn(t, s)
		leaks.check(t)
	})
}

// leakWatch is topology's LeakWatch for a test: it ends with the test, and
// ignores the node's own addresses on the pod side.
type leakWatch struct{ *topology.LeakWatch }

// watchLeaks watches dev in n for packets from sources until the test ends.
func watchLeaks(t testing.TB, n *topology.Netns, dev string, sources ...string) *leakWatch {
	t.Helper()
	var prefixes []netip.Prefix
	for _, s := range sources {
		prefixes = append(prefixes, netip.MustParsePrefix(s))
	}
	// The node's own addresses on the pod side are inside the pod CIDRs
	// but are no pod's: the kernel may pick them as a source (MASQUERADE
	// does when the uplink has no address of the family).
	w, err := topology.WatchLeaks(n, dev, []netip.Addr{nodePodSide4, nodePodSide6}, prefixes...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Close)
	return &leakWatch{w}
}

// allow: see topology.LeakWatch.Allow.
func (w *leakWatch) allow(dst netip.Addr, proto byte, sport uint16) { w.Allow(dst, proto, sport) }

// count is the number of packets recorded so far.
func (w *leakWatch) count() int { return len(w.Leaked()) }

// check fails the test if a masquerade source's address reached the wire.
func (w *leakWatch) check(t *testing.T) {
	t.Helper()
	if leaked := w.Leaked(); len(leaked) > 0 {
		t.Fatalf("%d packet(s) reached ext with an untranslated source, first: %s", len(leaked), leaked[0])
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// The node's addresses on pod0 (the pods' gateway).
var nodePodSide4, nodePodSide6 = netip.MustParseAddr("10.244.1.1"), netip.MustParseAddr("fd00:244::1")

// counter reads one datapath counter from the pinned map.
func (a *agent) counter(c bpf.Counter) uint64 {
	a.t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", bpf.MapCounters), nil)
	if err != nil {
		a.t.Fatal(err)
	}
	defer m.Close()
	vals, err := bpf.ReadCounters(m)
	if err != nil {
		a.t.Fatal(err)
	}
	return vals[c]
}

// attachedProgram returns the name of the program in the pinned link of
// a device's hook ("egress" or "ingress").
func (a *agent) attachedProgram(dev, hook string) string {
	a.t.Helper()
	l, err := a.node.NL.LinkByName(dev)
	if err != nil {
		a.t.Fatal(err)
	}
	pinned, err := link.LoadPinnedLink(filepath.Join(a.bpfRoot, "ipmasq", "links", fmt.Sprintf("%d-%s", l.Attrs().Index, hook)), nil)
	if err != nil {
		a.t.Fatal(err)
	}
	defer pinned.Close()
	info, err := pinned.Info()
	if err != nil {
		a.t.Fatal(err)
	}
	prog, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		a.t.Fatal(err)
	}
	defer prog.Close()
	pi, err := prog.Info()
	if err != nil {
		a.t.Fatal(err)
	}
	return pi.Name
}

// TestLeakWatchSeesPodAddresses: without any masquerade, a pod's datagram
// reaches ext with the pod's address and the watcher reports it, on an
// Ethernet and on an L3 link (so its silence in the scenarios means
// something).
func TestLeakWatchSeesPodAddresses(t *testing.T) {
	privtest.Require(t)
	for _, l3 := range []bool{false, true} {
		topo, err := topology.NewMasqueradeWith(topology.Options{L3Uplink: l3})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { topo.Close() })
		w := watchLeaks(t, topo.Ext, "eth0", topology.PodCIDR4, topology.PodCIDR6)
		for _, dst := range []netip.Addr{topology.RemoteIP4, topology.RemoteIP6} {
			udpSource(topo.Pod, dst) // no answer: ext has no route back
		}
		n := w.count()
		if n < 2 {
			t.Errorf("L3 uplink %v: the watcher saw %d leaked packets, want ≥ 2 (one per family)", l3, n)
		}
	}
}
