package perf

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

var (
	flagRounds      = flag.Int("perf.rounds", 10, "rounds; each measures every condition once, in a rotated order")
	flagTputTime    = flag.Duration("perf.tput-time", time.Second, "measured time of one throughput run (after 300ms of warmup)")
	flagFlowTime    = flag.Duration("perf.flow-time", 500*time.Millisecond, "measured time of one new-connections run (after 200ms of warmup)")
	flagServerClose = flag.Bool("perf.server-closes", false, "short connections: the server closes first and holds TIME_WAIT (default: the client does)")
	flagConns       = flag.Int("perf.conns", 4, "concurrent connection loops in the new-connections run")
	flagPorts       = flag.Int("perf.ports", 128, "server ports the short connections are spread over")
	flagCIDRs       = flag.String("perf.cidrs", "10,1000,10000", "non-masquerade CIDR counts to compare")
	flagRestore     = flag.String("perf.iptables-restore", "iptables-restore", "iptables-restore binary for the iptables condition (e.g. iptables-legacy-restore)")
	flagAgent       = flag.String("perf.agent", "", "a built ipmasq-agent to run (default: build ./cmd/ipmasq-agent)")
	flagBaseline    = flag.String("perf.baseline-agent", "", "another built ipmasq-agent (e.g. main's) measured beside ipmasq in the same rounds, as ipmasq-baseline")
	flagUnmasq      = flag.Bool("perf.unmasqueraded", false, "the destination is a non-masquerade one (pod-to-pod traffic through the node: routed back, never translated) under every condition")
	flagNATEntries  = flag.Int("perf.nat-max-entries", 1<<20, "ipmasq --nat-max-entries: a closed TCP pair is kept 2 minutes, and every run's connections stay in the map")
)

// CPUs the traffic processes are pinned to. The forwarding work of a packet
// (node's routing, NAT, the BPF programs) runs in softirq on the CPU that
// sent it: the client's CPU for data and SYNs, the server's for ACKs and
// replies.
const (
	clientCPU = 0
	serverCPU = 1
)

// condition is one way of getting the pod's traffic through the node, on
// its own copy of the topology.
type condition struct {
	kind   string // "routing", "ipmasq", "ipmasq-baseline" or "iptables"
	cidrs  int
	topo   *topology.Masquerade
	client *trafficProc
	pinDir string // ipmasq: the agent's pinned maps

	gbps, conns []float64 // per round
	failed      int64
}

func (c *condition) name() string {
	if c.kind == "routing" {
		return c.kind
	}
	return fmt.Sprintf("%s/cidrs=%d", c.kind, c.cidrs)
}

// trafficProc is a traffic process started from this test binary.
type trafficProc struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

func startTraffic(b *testing.B, ns *topology.Netns, cpu int, role string) *trafficProc {
	b.Helper()
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), RoleEnv+"="+role, FlowPortsEnv+"="+strconv.Itoa(*flagPorts))
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := StartPinned(ns, cpu, cmd); err != nil {
		b.Fatalf("start %s in %s: %v", role, ns.Name, err)
	}
	p := &trafficProc{cmd: cmd, in: in, out: bufio.NewReader(out)}
	b.Cleanup(func() {
		p.in.Close()
		done := make(chan struct{})
		go func() { p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			p.cmd.Process.Kill()
			<-done
		}
	})
	return p
}

func (p *trafficProc) do(req Request) (Result, error) {
	data, _ := json.Marshal(req)
	if _, err := p.in.Write(append(data, '\n')); err != nil {
		return Result{}, err
	}
	line, err := p.out.ReadBytes('\n')
	if err != nil {
		return Result{}, fmt.Errorf("client: %w", err)
	}
	var res Result
	if err := json.Unmarshal(line, &res); err != nil {
		return Result{}, err
	}
	if res.Err != "" {
		return res, fmt.Errorf("%s", res.Err)
	}
	return res, nil
}

// setUp builds the condition's topology, its NAT, and its traffic
// processes, and checks that a connection gets through.
func (c *condition) setUp(b *testing.B, agentBin string) {
	b.Helper()
	topo, err := topology.NewMasquerade()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { topo.Close() })
	c.topo = topo
	if c.kind == "routing" || *flagUnmasq {
		if err := topo.RouteBack(); err != nil {
			b.Fatal(err)
		}
	}
	switch c.kind {
	case "ipmasq":
		c.pinDir = runAgent(b, agentBin, topo.Node, configCIDRs(c.cidrs), *flagNATEntries)
	case "ipmasq-baseline":
		c.pinDir = runAgent(b, *flagBaseline, topo.Node, configCIDRs(c.cidrs), *flagNATEntries)
	case "iptables":
		installIPMasqAgentRules(b, *flagRestore, topo.Node, configCIDRs(c.cidrs))
	}
	server := startTraffic(b, topo.Ext, serverCPU, RoleServer)
	if line, err := server.out.ReadString('\n'); err != nil || line != "ready\n" {
		b.Fatalf("%s: server did not start: %q %v", c.name(), line, err)
	}
	c.client = startTraffic(b, topo.Pod, clientCPU, RoleClient)
	// ext has no route back to the pod except under routing (and
	// -perf.unmasqueraded): a connection that completes was masqueraded by
	// the condition's NAT.
	if _, err := c.client.do(Request{Op: "check", Addr: topology.RemoteIP4.String()}); err != nil {
		b.Fatalf("%s: no connection through the node: %v", c.name(), err)
	}
}

// BenchmarkDatapath measures TCP throughput and new connections per second
// from the pod to 203.0.113.10 through the node under plain routing,
// ipmasq and the ip-masq-agent iptables chain at several CIDR counts, all
// in one run, interleaved in rounds. The work happens once, whatever b.N;
// the sub-benchmarks report medians of the rounds and medians of the
// per-round ratios.
func BenchmarkDatapath(b *testing.B) {
	privtest.Require(b)
	var counts []int
	for _, s := range strings.FieldsFunc(*flagCIDRs, func(r rune) bool { return r == ',' }) {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 0 {
			b.Fatalf("-perf.cidrs=%q: want a comma-separated list of counts", *flagCIDRs)
		}
		counts = append(counts, n)
	}
	agentBin := *flagAgent
	if agentBin == "" {
		agentBin = buildAgent(b)
	}
	conds := []*condition{{kind: "routing"}}
	for _, n := range counts {
		conds = append(conds, &condition{kind: "ipmasq", cidrs: n})
		if *flagBaseline != "" {
			conds = append(conds, &condition{kind: "ipmasq-baseline", cidrs: n})
		}
		conds = append(conds, &condition{kind: "iptables", cidrs: n})
	}
	for _, c := range conds {
		c.setUp(b, agentBin)
	}

	tput := Request{Op: "throughput", Addr: topology.RemoteIP4.String(), Warmup: 300 * time.Millisecond, Duration: *flagTputTime}
	flows := Request{Op: "flows", Addr: topology.RemoteIP4.String(), Ports: *flagPorts, Conns: *flagConns, ClientCloses: !*flagServerClose, Warmup: 200 * time.Millisecond, Duration: *flagFlowTime}
	for r := range *flagRounds {
		order := slices.Concat(conds[r%len(conds):], conds[:r%len(conds)])
		for _, c := range order {
			res, err := c.client.do(tput)
			if err != nil {
				b.Fatalf("round %d, %s, throughput: %v", r, c.name(), err)
			}
			c.gbps = append(c.gbps, float64(res.Bytes)*8/res.Seconds/1e9)
		}
		for _, c := range order {
			res, err := c.client.do(flows)
			if err != nil {
				b.Fatalf("round %d, %s, new connections: %v", r, c.name(), err)
			}
			c.conns = append(c.conns, float64(res.OK)/res.Seconds)
			c.failed += res.Failed
		}
	}

	report(b, conds)
}

// report logs the table and hands each condition's figures to a
// sub-benchmark, so that they print as benchmark metrics.
func report(b *testing.B, conds []*condition) {
	byName := map[string]*condition{}
	for _, c := range conds {
		byName[c.name()] = c
	}
	routing := byName["routing"]
	var log strings.Builder
	fmt.Fprintf(&log, "%d rounds; medians; ratios are medians of per-round ratios\n", *flagRounds)
	fmt.Fprintf(&log, "%-27s %9s %9s %10s %10s %10s %10s %10s %10s  %s\n", "condition", "Gbit/s", "conn/s", "tput/rout", "conn/rout", "tput/ipt", "conn/ipt", "tput/base", "conn/base", "per round conn/s")
	for _, c := range conds {
		metrics := map[string]float64{
			"Gbit/s":      median(c.gbps),
			"conn/s":      median(c.conns),
			"failed-conn": float64(c.failed),
		}
		if c != routing {
			metrics["tput/routing"] = medianRatio(c.gbps, routing.gbps)
			metrics["conn/routing"] = medianRatio(c.conns, routing.conns)
		}
		if c.kind == "ipmasq" || c.kind == "ipmasq-baseline" {
			ipt := byName[fmt.Sprintf("iptables/cidrs=%d", c.cidrs)]
			metrics["tput/iptables"] = medianRatio(c.gbps, ipt.gbps)
			metrics["conn/iptables"] = medianRatio(c.conns, ipt.conns)
		}
		if base := byName[fmt.Sprintf("ipmasq-baseline/cidrs=%d", c.cidrs)]; c.kind == "ipmasq" && base != nil {
			metrics["tput/baseline"] = medianRatio(c.gbps, base.gbps)
			metrics["conn/baseline"] = medianRatio(c.conns, base.conns)
		}
		fmt.Fprintf(&log, "%-27s %9.2f %9.0f %10s %10s %10s %10s %10s %10s  %.0f\n", c.name(), metrics["Gbit/s"], metrics["conn/s"],
			ratioText(metrics, "tput/routing"), ratioText(metrics, "conn/routing"),
			ratioText(metrics, "tput/iptables"), ratioText(metrics, "conn/iptables"),
			ratioText(metrics, "tput/baseline"), ratioText(metrics, "conn/baseline"), c.conns)
		if c.pinDir != "" {
			counters, err := datapathCounters(c.pinDir)
			if err != nil {
				b.Errorf("%s: counters: %v", c.name(), err)
			}
			fmt.Fprintf(&log, "%27s datapath counters: %v\n", "", counters)
		}
		if c.failed > 0 {
			fmt.Fprintf(&log, "%27s %d connections failed (timeouts: dropped SYNs?)\n", "", c.failed)
		}
		b.Run(c.name(), func(b *testing.B) {
			for unit, v := range metrics {
				b.ReportMetric(v, unit)
			}
			b.ReportMetric(0, "ns/op")
		})
	}
	// b.Log of a benchmark with sub-benchmarks shows only with -v: the
	// table goes to the benchmark output directly.
	fmt.Print(log.String())
}

func ratioText(m map[string]float64, key string) string {
	if v, ok := m[key]; ok {
		return fmt.Sprintf("%.3f", v)
	}
	return "-"
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// medianRatio is the median over rounds of a[r]/b[r]: conditions of the
// same round share the machine's state, so their ratio is steadier than a
// ratio of medians.
func medianRatio(a, b []float64) float64 {
	var rs []float64
	for i := range min(len(a), len(b)) {
		if b[i] > 0 {
			rs = append(rs, a[i]/b[i])
		}
	}
	return median(rs)
}
