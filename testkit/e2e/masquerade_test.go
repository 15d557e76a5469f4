package e2e

import (
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// setup builds the topology, starts the servers in ext and far and the
// agent in the node with config.
func setup(t *testing.T, config string, agentArgs ...string) (*topology.Masquerade, *agent, *servers) {
	t.Helper()
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	ext := startServers(t, topo.Ext, topology.ExtIP4, topology.ExtIP6, topology.RemoteIP4, topology.RemoteIP6)
	startServers(t, topo.Far, topology.FarIP4, topology.FarIP6)
	a := newAgent(t, topo.Node, config)
	a.args = agentArgs
	a.start()
	return topo, a, ext
}

var echoIDs atomic.Uint32

const masqueradeAll = "nonMasqueradeCIDRs: []\nmasqLinkLocal: false\nmasqLinkLocalIPv6: false\n"

// checkSource opens flows of every protocol from the pod to dst and checks
// the source address the far end saw.
func checkSource(t *testing.T, topo *topology.Masquerade, ext *servers, dst, want netip.Addr, flows int) {
	t.Helper()
	for i := range flows {
		if seen, err := tcpSource(topo.Pod, dst); err != nil || seen != want.String() {
			t.Fatalf("TCP flow %d to %s: server saw %q (%v), want %s", i, dst, seen, err, want)
		}
		if seen, err := udpSource(topo.Pod, dst); err != nil || seen != want.String() {
			t.Fatalf("UDP flow %d to %s: server saw %q (%v), want %s", i, dst, seen, err, want)
		}
	}
	ext.resetEcho()
	// A new identifier each time: an echo "flow" with a known identifier
	// keeps its translation until it expires, like any established flow.
	id := uint16(echoIDs.Add(1))
	for i := range flows {
		if err := ping(topo.Pod, dst, id, uint16(i)); err != nil {
			t.Fatalf("ping %d to %s: %v", i, dst, err)
		}
	}
	if dst == topology.ExtIP4 || dst == topology.ExtIP6 || dst == topology.RemoteIP4 || dst == topology.RemoteIP6 {
		// The observer reads the requests asynchronously.
		var srcs []netip.Addr
		for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if srcs = ext.echoSources(); len(srcs) >= flows {
				break
			}
		}
		if len(srcs) < flows {
			t.Fatalf("ext saw %d echo requests, want %d", len(srcs), flows)
		}
		for _, s := range srcs {
			if s != want {
				t.Fatalf("ext saw an echo request from %s, want %s", s, want)
			}
		}
	}
}

func TestMasqueradeIPv4(t *testing.T) {
	underBoth(t, masqueradePods(), func(t *testing.T, s *scenario) {
		// ext has no route to the pod CIDR: only masqueraded traffic works.
		checkSource(t, s.topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 20)
		checkSource(t, s.topo, s.ext, topology.ExtIP4, topology.NodeIP4, 5)
	})
}

func TestMasqueradeIPv6(t *testing.T) {
	underBoth(t, masqueradePods(), func(t *testing.T, s *scenario) {
		checkSource(t, s.topo, s.ext, topology.RemoteIP6, topology.NodeIP6, 20)
		checkSource(t, s.topo, s.ext, topology.ExtIP6, topology.NodeIP6, 5)
	})
}

// TestNonMasqueradeDestination: a destination inside nonMasqueradeCIDRs sees
// the pod address; a config change flips that for new flows while the agent
// runs, and back.
func TestNonMasqueradeDestination(t *testing.T) {
	topo, a, ext := setup(t, "nonMasqueradeCIDRs: [10.0.0.0/24, 2001:db8::/64]\nmasqLinkLocal: true\nmasqLinkLocalIPv6: true\n")
	if err := topo.RouteBack(); err != nil {
		t.Fatal(err)
	}
	a.waitMaps("nonmasq_v4 10.0.0.0/24 no-masquerade\nnonmasq_v6 2001:db8::/64 no-masquerade\n")
	checkSource(t, topo, ext, topology.ExtIP4, topology.PodIP4, 5)
	checkSource(t, topo, ext, topology.ExtIP6, topology.PodIP6, 5)
	// Outside the non-masquerade ranges: masqueraded.
	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 5)
	checkSource(t, topo, ext, topology.RemoteIP6, topology.NodeIP6, 5)

	// masqueradeCIDRs: an exception inside the range is masqueraded.
	a.writeConfig("nonMasqueradeCIDRs: [10.0.0.0/24, 2001:db8::/64]\nmasqueradeCIDRs: [10.0.0.2/32, 2001:db8::2/128]\nmasqLinkLocal: true\nmasqLinkLocalIPv6: true\n")
	a.waitMaps("nonmasq_v4 10.0.0.0/24 no-masquerade\nnonmasq_v4 10.0.0.2/32 masquerade\nnonmasq_v6 2001:db8::/64 no-masquerade\nnonmasq_v6 2001:db8::2/128 masquerade\n")
	checkSource(t, topo, ext, topology.ExtIP4, topology.NodeIP4, 5)
	checkSource(t, topo, ext, topology.ExtIP6, topology.NodeIP6, 5)

	// The config changes: everything is masqueraded for new flows.
	a.writeConfig(masqueradeAll)
	a.waitMaps("nonmasq_v4 169.254.0.0/16 no-masquerade\nnonmasq_v6 fe80::/10 no-masquerade\n")
	checkSource(t, topo, ext, topology.ExtIP4, topology.NodeIP4, 5)
	checkSource(t, topo, ext, topology.ExtIP6, topology.NodeIP6, 5)
}

// TestHostTrafficUntouched: the node's own connections, outgoing and
// incoming, pass the programs unchanged while pods are masqueraded.
func TestHostTrafficUntouched(t *testing.T) {
	underBoth(t, masqueradePods(), func(t *testing.T, s *scenario) {
		topo, ext := s.topo, s.ext
		for _, dst := range []netip.Addr{topology.RemoteIP4, topology.RemoteIP6} {
			want := topology.NodeIP4
			if dst.Is6() {
				want = topology.NodeIP6
			}
			for i := range 10 {
				if seen, err := tcpSource(topo.Node, dst); err != nil || seen != want.String() {
					t.Fatalf("node's own TCP flow %d to %s: %q %v", i, dst, seen, err)
				}
				if seen, err := udpSource(topo.Node, dst); err != nil || seen != want.String() {
					t.Fatalf("node's own UDP flow %d to %s: %q %v", i, dst, seen, err)
				}
			}
		}
		// Incoming: ext connects to a server on the node.
		startServers(t, topo.Node, topology.NodeIP4, topology.NodeIP6)
		for _, dst := range []netip.Addr{topology.NodeIP4, topology.NodeIP6} {
			want := topology.ExtIP4
			if dst.Is6() {
				want = topology.ExtIP6
			}
			if seen, err := tcpSource(topo.Ext, dst); err != nil || seen != want.String() {
				t.Fatalf("incoming connection to the node %s: %q %v", dst, seen, err)
			}
		}
		// And pods are still masqueraded.
		checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 2)
	})
}

// TestNodeLinkTrafficUntouched: the node's own packets for the link alone
// pass the programs unchanged and make no NAT pair, although 0.0.0.0/0 and
// ::/0 are masquerade sources: here the duplicate address detection probe
// of an address added to the uplink while the agent runs, which leaves
// from the unspecified address (a DAD probe or an MLD report from :: when
// the agent starts at the same time as the uplink did this too).
func TestNodeLinkTrafficUntouched(t *testing.T) {
	// The reference masquerades every source, as the agent's default does.
	spec := setupSpec{config: masqueradeAll, sources: []string{"0.0.0.0/0", "::/0"}}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		topo := s.topo
		probes := watchSolicitations(t, topo.Ext, "eth0")
		eth0, err := topo.Node.NL.LinkByName("eth0")
		if err != nil {
			t.Fatal(err)
		}
		added := netip.MustParseAddr("2001:db8::77")
		// With duplicate address detection (topology.Netns.Addr skips it).
		if err := topo.Node.NL.AddrAdd(eth0, &netlink.Addr{IPNet: &net.IPNet{IP: added.AsSlice(), Mask: net.CIDRMask(64, 128)}}); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(15 * time.Second); len(probes.of(added)) == 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("no DAD probe of %s on ext", added)
			}
		}
		for _, src := range probes.of(added) {
			if src != netip.IPv6Unspecified() {
				t.Errorf("the DAD probe of %s reached ext from %s, want ::", added, src)
			}
		}
		a := s.agent
		if a == nil {
			return // the reference: no counters
		}
		for _, c := range []bpf.Counter{bpf.CounterNATNew, bpf.CounterNATNewAddrOnly, bpf.CounterMasqueraded} {
			if n := a.counter(c); n != 0 {
				t.Errorf("%s = %d, want 0", c, n)
			}
		}
		if nat := natCommand(t, a); nat != "" {
			t.Errorf("NAT pairs of the node's own link traffic:\n%s", nat)
		}
	})
}

// solicitations records the targets and sources of the neighbour
// solicitations seen on a device.
type solicitations struct {
	mu  sync.Mutex
	src map[netip.Addr][]netip.Addr // target → sources
}

func (s *solicitations) of(target netip.Addr) []netip.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.src[target])
}

// watchSolicitations records the neighbour solicitations on dev in n
// (without extension headers, as the kernel sends them) until the test
// ends.
func watchSolicitations(t *testing.T, n *topology.Netns, dev string) *solicitations {
	t.Helper()
	f, err := topology.OpenPacketSocket(n, dev, unix.ETH_P_IPV6)
	if err != nil {
		t.Fatal(err)
	}
	s := &solicitations{src: map[netip.Addr][]netip.Addr{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			m, err := f.Read(buf)
			if err != nil {
				return
			}
			// IPv6, next header ICMPv6, type 135; the target follows the
			// 4 reserved bytes.
			if m < 40+24 || buf[0]>>4 != 6 || buf[6] != 58 || buf[40] != 135 {
				continue
			}
			src, target := netip.AddrFrom16([16]byte(buf[8:24])), netip.AddrFrom16([16]byte(buf[48:64]))
			s.mu.Lock()
			s.src[target] = append(s.src[target], src)
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() { f.Close(); <-done })
	return s
}

// TestStatusAndShell: "ipmasq-agent status" and "ipmasq-agent shell <cmd>"
// talk to the running agent over its shell socket.
func TestStatusAndShell(t *testing.T) {
	topo, a, ext := setup(t, masqueradeAll)
	// One flow of each protocol: three NAT pairs, six entries.
	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 1)
	sock := "--shell-sock-path=" + filepath.Join(a.dir, "shell.sock")
	out, err := exec.Command(agentBin, "status", sock).CombinedOutput()
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	for _, want := range []string{"Config:", "generation 1", "Devices:    selected eth0 (10.0.0.5, 2001:db8::5; default route)\n", "Readiness:  ready\n",
		"Datapath:   attached to eth0 [Done]"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	// 6 IPv4 entries and no IPv6 one, each of its family's own capacity.
	if nat := regexp.MustCompile(`(?m)^NAT:        6 of [0-9]+ IPv4 and 0 of [0-9]+ IPv6 entries`); !nat.Match(out) {
		t.Errorf("status lacks %q:\n%s", nat, out)
	}
	out, err = exec.Command(agentBin, "shell", sock, "datapath/nat").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "masquerade ipv4 tcp tcp-") || !strings.Contains(string(out), " 10.244.1.2:") {
		t.Fatalf("shell datapath/nat: %v\n%s", err, out)
	}
	out, err = exec.Command(agentBin, "status", "--shell-sock-path=/nonexistent/shell.sock").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "no agent shell at /nonexistent/shell.sock") {
		t.Fatalf("status without an agent: %v\n%s", err, out)
	}
}

// TestMetrics: /metrics follows masqueraded traffic and config changes, and
// /healthz turns 503 on a rejected config.
func TestMetrics(t *testing.T) {
	topo, a, ext := setup(t, masqueradeAll, "--prometheus-serve-addr="+metricsAddr)
	get := func(path string) (int, string) { return scrape(t, topo.Node, path) }
	_, before := get("/metrics")
	if !strings.Contains(before, `ipmasq_config_valid 1`) || !strings.Contains(before, `ipmasq_nat_entries{family="ipv4"} 0`) {
		t.Fatalf("metrics before traffic:\n%s", grepLines(before, "ipmasq_config_valid|ipmasq_nat_entries"))
	}
	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 1)
	_, after := get("/metrics")
	for _, want := range []string{`ipmasq_nat_entries{family="ipv4"} 6`, `ipmasq_datapath_packets_total{counter="nat-new"} 3`} {
		if !strings.Contains(after, want) {
			t.Errorf("after traffic, metrics lack %q:\n%s", want, grepLines(after, "ipmasq_nat_entries|ipmasq_datapath_packets_total"))
		}
	}
	if code, _ := get("/healthz"); code != 200 {
		t.Fatalf("/healthz = %d, want 200", code)
	}
	a.writeConfig("nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	a.waitFor("/healthz 503 after a rejected config", func() bool { code, _ := get("/healthz"); return code == 503 })
	_, bad := get("/metrics")
	for _, want := range []string{"ipmasq_config_valid 0", "ipmasq_config_load_failures_total 1"} {
		if !strings.Contains(bad, want) {
			t.Errorf("after a rejected config, metrics lack %q:\n%s", want, grepLines(bad, "ipmasq_config"))
		}
	}
}

func grepLines(s, re string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if ok, _ := regexp.MatchString(re, l); ok {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
