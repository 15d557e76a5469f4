package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
)

// agentFigures are what one scenario measured on the agent process.
type agentFigures struct {
	rssMiB, peakMiB    float64 // VmRSS after 2 s idle, VmHWM over the agent's life
	anonMiB, fileMiB   float64 // VmRSS's anonymous (heap, stacks) and file-backed (the binary) parts
	allocP50, allocP99 time.Duration
	converge           time.Duration // start → all in the kernel
	ipBatch            time.Duration // the same rules with ip -batch, same run
}

// memory reads the agent's VmRSS and VmHWM from /proc, and the parts of
// VmRSS: RssAnon (the Go heap, stacks, runtime) and RssFile (pages of the
// binary mapped into the process).
func (a *agent) memory() (rssMiB, peakMiB, anonMiB, fileMiB float64) {
	a.t.Helper()
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", a.cmd.Process.Pid))
	if err != nil {
		a.t.Fatal(err)
	}
	for _, l := range strings.Split(string(status), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		kib, _ := strconv.Atoi(f[1])
		switch f[0] {
		case "VmRSS:":
			rssMiB = float64(kib) / 1024
		case "VmHWM:":
			peakMiB = float64(kib) / 1024
		case "RssAnon:":
			anonMiB = float64(kib) / 1024
		case "RssFile:":
			fileMiB = float64(kib) / 1024
		}
	}
	return rssMiB, peakMiB, anonMiB, fileMiB
}

// allocateMany allocates n IPv4 addresses over the agent's API socket, as
// a CNI plugin does, and returns the latencies' median and 99th percentile.
func (a *agent) allocateMany(prefix string, n int, table *uint32) (p50, p99 time.Duration) {
	a.t.Helper()
	c := ipamapi.NewClient(filepath.Join(a.dir, "api.sock"))
	lat := make([]time.Duration, 0, n)
	for i := range n {
		start := time.Now()
		_, err := c.Allocate(context.Background(), ipamapi.AllocationRequest{Owner: fmt.Sprintf("%s-%d/eth0", prefix, i), Family: "ipv4", RouteTable: table})
		lat = append(lat, time.Since(start))
		if err != nil {
			a.t.Fatalf("allocation %d: %v", i, err)
		}
	}
	return percentiles(lat)
}

// ipBatchRules installs the rules the agent derives for n seeded endpoints
// (route table 11, priority 111, the agent's protocol) with one `ip -batch`
// in a fresh namespace, and returns how long it took: the baseline of the
// agent's start → all rules in the kernel.
func ipBatchRules(b *testing.B, n int, to []string) time.Duration {
	b.Helper()
	ns, err := topology.NewNetns("ip-batch")
	if err != nil {
		b.Fatal(err)
	}
	defer ns.Close()
	var script strings.Builder
	base := netip.MustParsePrefix(loadPool).Addr().As4()
	for i := range n {
		ip := base
		ip[2], ip[3] = byte((i+1)>>8), byte(i+1)
		for _, dst := range to {
			fmt.Fprintf(&script, "rule add priority 111 from %s/32 to %s lookup 11 protocol %d\n", netip.AddrFrom4(ip), dst, iprules.Protocol)
		}
	}
	cmd := exec.Command("ip", "-batch", "-")
	cmd.Stdin = strings.NewReader(script.String())
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := ns.Start(cmd); err != nil {
		b.Fatalf("ip -batch: %v", err)
	}
	if err := cmd.Wait(); err != nil {
		b.Fatalf("ip -batch: %v\n%s", err, out.String())
	}
	took := time.Since(start)
	if got := tableRules(ns, 11); got != n*len(to) {
		b.Fatalf("ip -batch installed %d rules, want %d", got, n*len(to))
	}
	return took
}

// BenchmarkAgentMemory runs the real ipmasq-agent binary in a node
// namespace and reads its memory from /proc in the three scenarios of
// issue #14 (budget: < 60 MiB each), with the API latency seen by a client
// of the socket. The work happens once, whatever b.N; the sub-benchmarks
// report the figures.
//
//   - cidrs=16384: 16 384 CIDRs per family, maps full;
//   - cidrs=16384,endpoints=1000: the same agent after 1 000 allocations
//     over the API (no route table), each answer carrying 16 384 CIDRs;
//   - endpoints=10000: the seed config and 10 000 endpoints with route
//     table 11 restored from the state file, 20 000 rules in the kernel
//     (start → all there, against `ip -batch` of the same rules in a fresh
//     namespace just before and just after, same run), then 300
//     allocations over the API.
func BenchmarkAgentMemory(b *testing.B) {
	figures := map[string]agentFigures{}

	func() {
		topo, err := topology.NewMasquerade()
		if err != nil {
			b.Fatal(err)
		}
		defer topo.Close()
		a := newAgent(b, topo.Node, loadCIDRConfig(loadCIDRs))
		a.args = []string{"--pod-cidr=" + loadPool}
		start := time.Now()
		a.start()
		a.waitLong("the maps to hold every CIDR", func() bool { v4, v6 := a.mapEntries(); return v4 >= loadCIDRs && v6 >= loadCIDRs })
		f := agentFigures{converge: time.Since(start)}
		time.Sleep(2 * time.Second)
		f.rssMiB, f.peakMiB, f.anonMiB, f.fileMiB = a.memory()
		figures["cidrs=16384"] = f

		f.allocP50, f.allocP99 = a.allocateMany("ctr", 1000, nil)
		time.Sleep(2 * time.Second)
		f.rssMiB, f.peakMiB, f.anonMiB, f.fileMiB = a.memory()
		figures["cidrs=16384,endpoints=1000"] = f
		a.stop(9)
	}()

	func() {
		topo, err := topology.NewMasquerade()
		if err != nil {
			b.Fatal(err)
		}
		defer topo.Close()
		a := newAgent(b, topo.Node, "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: false\n")
		a.args = []string{"--pod-cidr=" + loadPool}
		seedEndpoints(b, a, loadEndpoints)
		// The baseline runs before and after the agent and counts as their
		// mean, so that a change of the VM's load during the run weighs on
		// both sides.
		batchBefore := ipBatchRules(b, loadEndpoints, []string{"10.0.0.0/8", "169.254.0.0/16"})
		start := time.Now()
		a.start()
		want := 2 * loadEndpoints
		a.waitLong(fmt.Sprintf("%d rules for table 11", want), func() bool { return tableRules(topo.Node, 11) >= want })
		f := agentFigures{converge: time.Since(start)}
		batchAfter := ipBatchRules(b, loadEndpoints, []string{"10.0.0.0/8", "169.254.0.0/16"})
		f.ipBatch = (batchBefore + batchAfter) / 2
		b.Logf("ip -batch of the same rules: %v before the agent, %v after", batchBefore, batchAfter)
		f.allocP50, f.allocP99 = a.allocateMany("new", 300, nil)
		time.Sleep(2 * time.Second)
		f.rssMiB, f.peakMiB, f.anonMiB, f.fileMiB = a.memory()
		figures["endpoints=10000"] = f
		a.stop(9)
	}()

	for _, name := range []string{"cidrs=16384", "cidrs=16384,endpoints=1000", "endpoints=10000"} {
		f := figures[name]
		b.Logf("%s: RSS %.1f MiB (anonymous %.1f, file %.1f; peak %.1f MiB), converged in %v, allocation p50 %v p99 %v",
			name, f.rssMiB, f.anonMiB, f.fileMiB, f.peakMiB, f.converge, f.allocP50, f.allocP99)
		b.Run(name, func(b *testing.B) {
			b.ReportMetric(f.rssMiB, "rss-MiB")
			b.ReportMetric(f.peakMiB, "peak-MiB")
			b.ReportMetric(f.anonMiB, "rss-anon-MiB")
			b.ReportMetric(f.fileMiB, "rss-file-MiB")
			b.ReportMetric(f.rssMiB/60, "rss/budget")
			b.ReportMetric(f.converge.Seconds(), "converge-s")
			if f.ipBatch > 0 {
				b.ReportMetric(f.ipBatch.Seconds(), "ip-batch-s")
				b.ReportMetric(float64(f.converge)/float64(f.ipBatch), "converge/ip-batch")
			}
			if f.allocP99 > 0 {
				b.ReportMetric(ms(f.allocP50), "alloc-p50-ms")
				b.ReportMetric(ms(f.allocP99), "alloc-p99-ms")
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}
