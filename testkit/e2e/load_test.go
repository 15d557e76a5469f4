package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
)

// Load figures: what an agent costs and how fast it converges at the sizes
// the issue promises (10 000 endpoints, 16 384 CIDRs per family). The
// figures are logged; the assertions are only that it converges at all
// within a minute.

const (
	loadEndpoints = 10000
	loadCIDRs     = 16384
	// loadPool holds the pre-seeded endpoints (an extra --pod-cidr, so
	// they are not "outside the pools").
	loadPool = "10.96.0.0/16"
)

// seedEndpoints writes n IPv4 endpoints with route table 11 into the
// agent's state directory, as a previous run would have left them.
func seedEndpoints(t testing.TB, a *agent, n int) {
	t.Helper()
	store, err := ipam.NewStore(filepath.Join(a.dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	base := netip.MustParsePrefix(loadPool).Addr().As4()
	created := time.Now().UTC().Truncate(time.Second)
	eps := make([]*tables.Endpoint, 0, n)
	for i := range n {
		ip := base
		ip[2], ip[3] = byte((i+1)>>8), byte(i+1)
		eps = append(eps, &tables.Endpoint{IP: netip.AddrFrom4(ip), Owner: fmt.Sprintf("ctr-%d/eth0", i), RouteTable: 11, Created: created})
	}
	if err := store.Save(eps); err != nil {
		t.Fatal(err)
	}
}

// procStats returns the agent's resident memory and its CPU time so far.
func (a *agent) procStats() (rssKiB int, cpu time.Duration) {
	a.t.Helper()
	pid := a.cmd.Process.Pid
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		a.t.Fatal(err)
	}
	for _, l := range strings.Split(string(status), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			rssKiB, _ = strconv.Atoi(f[1])
		}
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		a.t.Fatal(err)
	}
	// Fields after the command name: state is field 3, utime 14, stime 15.
	f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	utime, _ := strconv.Atoi(f[11])
	stime, _ := strconv.Atoi(f[12])
	const ticks = 100 // USER_HZ
	return rssKiB, time.Duration(utime+stime) * time.Second / ticks
}

// idleCPU measures the agent's CPU use over a 2 s window with nothing to do.
func (a *agent) idleCPU() (rssKiB int, used time.Duration) {
	_, before := a.procStats()
	time.Sleep(2 * time.Second)
	rssKiB, after := a.procStats()
	return rssKiB, after - before
}

// waitLong is waitFor with a longer deadline and a slower poll, for
// conditions that take seconds and are costly to check.
// The poll is slow (250 ms) so that dumping 20 000 rules does not compete
// with the agent for the kernel's locks.
func (a *agent) waitLong(what string, cond func() bool) time.Duration {
	a.t.Helper()
	start := time.Now()
	for deadline := start.Add(90 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		if cond() {
			return time.Since(start)
		}
	}
	a.t.Fatalf("timed out after 90 s waiting for %s", what)
	return 0
}

// tableRules counts the node's ip rules that look up table.
func tableRules(node *topology.Netns, table uint32) int {
	keys, err := iprules.NewNetlinkTarget(node.NL).List()
	if err != nil {
		return -1
	}
	n := 0
	for _, k := range keys {
		if k.Table == table {
			n++
		}
	}
	return n
}

// mapEntries counts the entries of nonmasq_v4 and nonmasq_v6 (-1: not
// pinned yet).
func (a *agent) mapEntries() (v4, v6 int) {
	count := func(name string) int {
		m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return -1
		}
		defer m.Close()
		n := 0
		var k, v []byte
		it := m.Iterate()
		for it.Next(&k, &v) {
			n++
		}
		return n
	}
	return count(bpf.MapNonMasqV4), count(bpf.MapNonMasqV6)
}

// TestLoadSteadyStateRules: 10 000 endpoints restored from the state file,
// two no-masquerade CIDRs each (10.0.0.0/8 and link-local), so 20 000 ip
// rules. Reports the time until all rules are in the kernel, RSS and idle
// CPU, and the time to converge after a CIDR is added (10 000 more rules).
//
// About 30 s: the kernel walks its rule list on every insert.
func TestLoadSteadyStateRules(t *testing.T) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	a := newAgent(t, topo.Node, "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: false\n")
	a.args = []string{"--pod-cidr=" + loadPool, "--log-level=info"}
	seedEndpoints(t, a, loadEndpoints)

	start := time.Now()
	a.start()
	attached := time.Since(start)
	want := 2 * loadEndpoints
	a.waitLong(fmt.Sprintf("%d rules for table 11", want), func() bool { return tableRules(topo.Node, 11) >= want })
	converged := time.Since(start)
	if got := tableRules(topo.Node, 11); got != want {
		t.Fatalf("%d rules for table 11, want %d", got, want)
	}
	rss, cpu := a.idleCPU()
	t.Logf("%d endpoints, %d rules: programs attached after %v, all rules in the kernel after %v", loadEndpoints, want, attached, converged)
	t.Logf("steady state: RSS %d KiB (%.1f MiB), CPU %v over a 2 s idle window (%.1f%%)", rss, float64(rss)/1024, cpu, 100*cpu.Seconds()/2)

	// One CIDR more: one more rule per endpoint.
	start = time.Now()
	a.writeConfig("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\nmasqLinkLocal: false\n")
	want = 3 * loadEndpoints
	a.waitLong(fmt.Sprintf("%d rules for table 11", want), func() bool { return tableRules(topo.Node, 11) >= want })
	changed := time.Since(start)
	rss, cpu = a.idleCPU()
	t.Logf("config change (+1 CIDR, +%d rules): converged after %v; then RSS %d KiB (%.1f MiB), CPU %v over 2 s idle",
		loadEndpoints, changed, rss, float64(rss)/1024, cpu)
	if got := tableRules(topo.Node, 11); got != want {
		t.Fatalf("%d rules for table 11 after the change, want %d", got, want)
	}
}

// loadCIDRConfig lists n IPv4 /24s in 10.128.0.0/9 and n IPv6 /64s in
// 2001:db8:1::/48 (plus extra, verbatim). Link-local is masqueraded, so
// that n CIDRs are n map entries: the default --max-nonmasq-cidrs (16 384)
// counts link-local too.
func loadCIDRConfig(n int, extra ...string) string {
	var b strings.Builder
	b.WriteString("masqLinkLocal: true\nmasqLinkLocalIPv6: true\nnonMasqueradeCIDRs:\n")
	for i := range n {
		fmt.Fprintf(&b, "  - 10.%d.%d.0/24\n", 128+i>>8, i&0xff)
		fmt.Fprintf(&b, "  - 2001:db8:1:%x::/64\n", i)
	}
	for _, e := range extra {
		fmt.Fprintf(&b, "  - %s\n", e)
	}
	return b.String()
}

// TestLoadSteadyStateCIDRs: 16 384 CIDRs per family in
// the no-masquerade maps. Reports the time until the maps hold them all,
// RSS and idle CPU, the time to converge after one CIDR is added, and that
// pods are still masqueraded (and not masqueraded to a listed CIDR).
func TestLoadSteadyStateCIDRs(t *testing.T) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	ext := startServers(t, topo.Ext, topology.ExtIP4, topology.ExtIP6, topology.RemoteIP4, topology.RemoteIP6)
	a := newAgent(t, topo.Node, loadCIDRConfig(loadCIDRs))

	start := time.Now()
	// Room for the one CIDR the config change adds.
	a.args = []string{"--log-level=info", fmt.Sprintf("--max-nonmasq-cidrs=%d", loadCIDRs+1)}
	a.start()
	attached := time.Since(start)
	want := loadCIDRs
	a.waitLong("the maps to hold every CIDR", func() bool { v4, v6 := a.mapEntries(); return v4 >= want && v6 >= want })
	converged := time.Since(start)
	v4, v6 := a.mapEntries()
	if v4 != want || v6 != want {
		t.Fatalf("maps hold %d IPv4 and %d IPv6 entries, want %d each", v4, v6, want)
	}
	rss, cpu := a.idleCPU()
	t.Logf("%d CIDRs per family: programs attached after %v, maps full after %v", loadCIDRs, attached, converged)
	t.Logf("steady state: RSS %d KiB (%.1f MiB), CPU %v over a 2 s idle window (%.1f%%)", rss, float64(rss)/1024, cpu, 100*cpu.Seconds()/2)

	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 2)
	checkSource(t, topo, ext, topology.RemoteIP6, topology.NodeIP6, 2)

	start = time.Now()
	a.writeConfig(loadCIDRConfig(loadCIDRs, "203.0.113.0/24", "2001:db8:ff::/64"))
	a.waitLong("the maps to hold the added CIDR", func() bool { v4, v6 := a.mapEntries(); return v4 == want+1 && v6 == want+1 })
	changed := time.Since(start)
	rss, cpu = a.idleCPU()
	t.Logf("config change (+1 CIDR per family): maps converged after %v; then RSS %d KiB (%.1f MiB), CPU %v over 2 s idle",
		changed, rss, float64(rss)/1024, cpu)
	// The added CIDR is remote's: the pod is no longer masqueraded there.
	if err := topo.RouteBack(); err != nil {
		t.Fatal(err)
	}
	checkSource(t, topo, ext, topology.RemoteIP4, topology.PodIP4, 2)
}

// natFullCount reads the drop-nat-table-full counter.
func (a *agent) natFullCount() int {
	for _, l := range strings.Split(a.counters(), "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "drop-nat-table-full" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

// TestNATFullHostTrafficWorks: with the NAT table full of open,
// established pod flows, a new pod flow is refused (counted in
// drop-nat-table-full, as conntrack refuses a new flow when it can drop no
// unassured entry) and never leaves with the pod's address; the
// established flows are not evicted for it, the node's own traffic, in
// both directions, is unaffected, and the pod flows in use keep working.
// The same flows run first under Linux MASQUERADE, the reference (its
// conntrack table is not limited to 64 entries, so it admits the new
// flows: it shows the scenario itself works on this topology).
func TestNATFullHostTrafficWorks(t *testing.T) {
	underBoth(t, masqueradePods("--nat-max-entries=64"), natFullHostTraffic)
}

func natFullHostTraffic(t *testing.T, s *scenario) {
	topo, a := s.topo, s.agent
	counters := func() string {
		if a == nil {
			return "(Linux MASQUERADE)"
		}
		return a.counters()
	}
	startServers(t, topo.Node, topology.NodeIP4, topology.NodeIP6)
	const capacity, attempts = 32, 35
	dst := netip.AddrPortFrom(topology.RemoteIP4, tcpPort)

	var open []net.Conn
	t.Cleanup(func() {
		for _, c := range open {
			c.Close()
		}
	})
	for i := range capacity {
		c, seen, err := topology.DialSource(topo.Pod, dst)
		if err != nil || seen != topology.NodeIP4.String() {
			t.Fatalf("pod flow %d of %d (table not yet full): %q %v\n%s", i, capacity, seen, err, counters())
		}
		open = append(open, c)
	}
	// The newer half is in use while new flows knock; the older half is
	// idle (an LRU table would have evicted it).
	busy := open[capacity/2:]
	echoAll := func(when string) {
		t.Helper()
		for i, c := range busy {
			msg := fmt.Sprintf("flow %d %s\n", i, when)
			c.SetDeadline(time.Now().Add(3 * time.Second))
			if _, err := c.Write([]byte(msg)); err != nil {
				t.Fatalf("pod flow in use %d %s: write: %v", i, when, err)
			}
			buf := make([]byte, len(msg))
			if _, err := readFull(c, buf); err != nil || string(buf) != msg {
				t.Fatalf("pod flow in use %d %s: echo %q %v", i, when, buf, err)
			}
		}
	}
	refused := 0
	for i := range attempts - capacity {
		echoAll(fmt.Sprintf("before new flow %d", i))
		c, seen, err := topology.DialSource(topo.Pod, dst)
		switch {
		case err == nil && seen == topology.NodeIP4.String():
			open = append(open, c)
		case err == nil:
			t.Fatalf("new pod flow %d beyond capacity seen as %q", i, seen)
		case a == nil:
			t.Fatalf("new pod flow %d under MASQUERADE: %v", i, err)
		default:
			refused++
		}
	}
	if a != nil {
		if refused != attempts-capacity {
			t.Errorf("%d of %d new flows refused with the table full of established flows:\n%s", refused, attempts-capacity, a.counters())
		}
		if full := a.natFullCount(); full == 0 {
			t.Errorf("refused flows not counted (drop-nat-table-full 0):\n%s", a.counters())
		}
	}
	// The idle established flows were not evicted for the new ones.
	for i, c := range open[:capacity/2] {
		msg := fmt.Sprintf("idle flow %d\n", i)
		c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatalf("idle pod flow %d: write: %v", i, err)
		}
		buf := make([]byte, len(msg))
		if _, err := readFull(c, buf); err != nil || string(buf) != msg {
			t.Fatalf("idle pod flow %d: echo %q %v\n%s", i, buf, err, counters())
		}
	}

	// The node's own flows, out and in, are not NATed and do not care.
	for _, dst := range []netip.Addr{topology.RemoteIP4, topology.RemoteIP6} {
		want := topology.NodeIP4
		if dst.Is6() {
			want = topology.NodeIP6
		}
		for i := range 5 {
			if seen, err := tcpSource(topo.Node, dst); err != nil || seen != want.String() {
				t.Errorf("node's own TCP flow %d to %s with the NAT table full: %q %v", i, dst, seen, err)
			}
			if seen, err := udpSource(topo.Node, dst); err != nil || seen != want.String() {
				t.Errorf("node's own UDP flow %d to %s with the NAT table full: %q %v", i, dst, seen, err)
			}
		}
	}
	for _, dst := range []netip.Addr{topology.NodeIP4, topology.NodeIP6} {
		if _, err := tcpSource(topo.Ext, dst); err != nil {
			t.Errorf("ext to the node %s with the NAT table full: %v", dst, err)
		}
	}

	// The pod flows in use still carry data both ways.
	echoAll("after the checks")
}

func readFull(c net.Conn, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		k, err := c.Read(buf[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
