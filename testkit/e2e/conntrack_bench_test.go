package e2e

import (
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

var (
	flagDestRates = flag.String("conntrack.rates", "300",
		"BenchmarkPerDestinationRate: new connections per second to try, comma-separated")
	flagDestDuration = flag.Duration("conntrack.duration", 150*time.Second,
		"BenchmarkPerDestinationRate: how long each rate is sustained")
	flagDestPods = flag.String("conntrack.pods", "1,50",
		"BenchmarkPerDestinationRate: pod addresses the connections rotate through (1: the pod's own), comma-separated")
)

// BenchmarkPerDestinationRate: a pod opens short TCP connections to one
// server address and port at a fixed rate for a long time (150 s by
// default, issue #11's figure), client closing first and server closing
// first, under Linux MASQUERADE and under ipmasq with default flags, in the
// same run, from one pod and from 50 (-conntrack.pods: the connections
// rotate through N pod addresses). Reported per condition: connections
// that succeeded and failed.
// The highest rate with 0 failures is the figure in
// docs/datapath-benchmarks.md. Each condition runs once, whatever b.N
// (make bench's -benchtime 20x would otherwise sustain it 21 times).
//
//	go test ./testkit/e2e/ -run '^$' -bench PerDestinationRate -conntrack.rates=300,1000 -conntrack.pods=1
func BenchmarkPerDestinationRate(b *testing.B) {
	rates := positiveInts(b, "-conntrack.rates", *flagDestRates)
	pods := positiveInts(b, "-conntrack.pods", *flagDestPods)
	measured := map[string]destRateResult{}
	for _, n := range pods {
		for _, name := range []string{"MASQUERADE", "ipmasq"} {
			for _, closer := range []byte{topology.ClientClosesFirst, topology.ServerClosesFirst} {
				for _, rate := range rates {
					cond := fmt.Sprintf("pods=%d/%s/%s-closes/rate=%d", n, name, closerName(closer), rate)
					b.Run(cond, func(b *testing.B) {
						// The framework calls a sub-benchmark again with a
						// larger b.N: the figures of the first call stand.
						res, ok := measured[cond]
						if !ok {
							res = perDestinationRate(b, name, closer, rate, n)
							measured[cond] = res
						}
						b.ReportMetric(float64(res.OK), "ok")
						b.ReportMetric(float64(res.Failed), "failed")
						if name == "ipmasq" {
							b.ReportMetric(float64(res.noPort), "drop-no-free-port")
						}
						b.ReportMetric(0, "ns/op")
					})
				}
			}
		}
	}
}

// positiveInts parses flag name's comma-separated value.
func positiveInts(b *testing.B, name, value string) []int {
	var out []int
	for _, s := range strings.Split(value, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			b.Fatalf("%s=%q: want positive integers", name, value)
		}
		out = append(out, n)
	}
	return out
}

// destRateResult is one condition of BenchmarkPerDestinationRate: the
// connections' outcome and, under ipmasq, the datapath's drops for want of
// a free NAT port.
type destRateResult struct {
	topology.RateResult
	noPort uint64
}

// perDestinationRate runs one condition of BenchmarkPerDestinationRate in
// a topology of its own: Linux MASQUERADE in the node, or the agent
// (name "ipmasq"), from pods pod addresses.
func perDestinationRate(b *testing.B, name string, closer byte, rate, pods int) destRateResult {
	topo, err := topology.NewMasquerade()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { topo.Close() })
	var a *agent
	if name == "ipmasq" {
		a = newAgent(b, topo.Node, masqueradeAll)
		a.start()
	} else {
		for _, src := range podSources {
			v6 := netip.MustParsePrefix(src).Addr().Is6()
			if err := topo.Node.Iptables(v6, "-t", "nat", "-A", "POSTROUTING", "-s", src, "-o", "eth0", "-j", "MASQUERADE"); err != nil {
				b.Fatal(err)
			}
		}
	}
	serveShort(b, topo.Ext)
	// One pod connects from its own address without binding (connect()
	// picks the port, as a client does); more rotate through bound
	// addresses.
	var sources []netip.Addr
	if pods > 1 {
		sources = podAddresses(b, topo.Pod, pods)
	}
	res := destRateResult{RateResult: topology.ConnectAtRateFrom(topo.Pod, sources,
		netip.AddrPortFrom(topology.RemoteIP4, shortPort), rate, *flagDestDuration, 5*time.Second, closer)}
	b.Logf("%s, %d pod addresses, %d/s for %s, %s closes first: %s", name, max(1, len(sources)), rate, *flagDestDuration, closerName(closer), res.RateResult)
	if a != nil {
		// Which failures the datapath dropped (a SYN with no free NAT
		// port), and which happened elsewhere (the generator's own
		// connect(), the server): dial timeouts look alike.
		b.Logf("datapath counters:\n%s", a.counters())
		res.noPort = a.counter(bpf.CounterNoPort)
	}
	return res
}

// BenchmarkNATTableRSS: the agent's memory with the IPv4 NAT map holding
// 1 M entries (500 000 established pairs) that its collector scans every
// second, against the same agent with the map empty (the baseline, same
// run). Reports both in MiB, the peak (VmHWM) and the ratio. The work
// happens once per call, whatever b.N.
func BenchmarkNATTableRSS(b *testing.B) {
	const entries = 1 << 20
	topo, err := topology.NewMasquerade()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { topo.Close() })
	a := newAgent(b, topo.Node, masqueradeAll)
	a.args = []string{fmt.Sprintf("--nat-max-entries=%d", entries), "--nat-gc-interval=1s"}
	a.start()
	time.Sleep(3 * time.Second)
	empty, _ := a.procStats()

	m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", bpf.MapNATV4), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	now := monotonicNs()
	keys := make([]bpf.NATKeyV4, 0, entries)
	vals := make([]bpf.NATValV4, 0, entries)
	snat := bpf.Addr4(topology.NodeIP4)
	for i := range entries / 2 {
		pod := bpf.Addr4(netip.AddrFrom4([4]byte{10, 244, byte(i >> 16), byte(i >> 8)}))
		remote := bpf.Addr4(netip.AddrFrom4([4]byte{203, 0, 113, byte(i)}))
		sport, nport := bpf.Port(uint16(1024+i%60000)), bpf.Port(uint16(61000+i%4536))
		keys = append(keys,
			bpf.NATKeyV4{Src: pod, Dst: remote, Sport: sport, Dport: bpf.Port(443), Proto: bpf.ProtoTCP, Dir: bpf.DirEgress},
			bpf.NATKeyV4{Src: remote, Dst: snat, Sport: bpf.Port(443), Dport: nport, Proto: bpf.ProtoTCP, Dir: bpf.DirIngress})
		vals = append(vals,
			bpf.NATValV4{Addr: snat, Port: nport, Flags: bpf.NATFlagSeen, LastSeenNs: now, CreatedNs: now},
			bpf.NATValV4{Addr: pod, Port: sport, Flags: bpf.NATFlagSeen, LastSeenNs: now, CreatedNs: now})
	}
	if _, err := m.BatchUpdate(keys, vals, nil); err != nil {
		b.Fatalf("fill nat_v4: %v", err)
	}
	keys, vals = nil, nil
	time.Sleep(10 * time.Second) // about ten collections, whatever b.N
	full, _ := a.procStats()
	peak := a.peakRSS()
	b.Logf("agent RSS: %d MiB with nat_v4 empty, %d MiB with %d entries (peak %d MiB)", empty>>10, full>>10, entries, peak>>10)
	b.ReportMetric(float64(empty)/1024, "MiB-empty")
	b.ReportMetric(float64(full)/1024, "MiB-1M")
	b.ReportMetric(float64(peak)/1024, "MiB-peak")
	b.ReportMetric(float64(full)/float64(empty), "ratio")
	b.ReportMetric(0, "ns/op")
}

// peakRSS is the agent's VmHWM in KiB.
func (a *agent) peakRSS() int {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", a.cmd.Process.Pid))
	if err != nil {
		a.t.Fatal(err)
	}
	for _, l := range strings.Split(string(status), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmHWM:" {
			v, _ := strconv.Atoi(f[1])
			return v
		}
	}
	return 0
}

func monotonicNs() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}
