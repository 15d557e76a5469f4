package e2e

import (
	"flag"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

var (
	flagDNSRate = flag.Int("dns.rate", 1000,
		"BenchmarkDNSBurst: queries per second, each from a fresh socket")
	flagDNSDuration = flag.Duration("dns.duration", 100*time.Second,
		"BenchmarkDNSBurst: how long the burst lasts")
	flagDNSNATMax = flag.Uint("dns.nat-max-entries", 0,
		"BenchmarkDNSBurst: ipmasq's --nat-max-entries (0: the agent's default, sized from the node); a small table puts the burst under pressure")
)

// BenchmarkDNSBurst: issue #22's DNS burst with an idle flow. A pod holds
// an idle database connection (TCP, a request and its answer before the
// burst) while the node's pods send 1 000 DNS queries a second from fresh
// sockets for 100 s, to one resolver, and the same burst split over two;
// then the idle connection sends another request. Under Linux MASQUERADE
// (iptables-nft in the node) and ipmasq with default flags, each on a
// fresh topology, in the same run; -dns.rate and -dns.duration make it
// shorter, -dns.nat-max-entries gives ipmasq a table small enough for the
// burst to fill. Reported per condition: queries sent and answered (open loop,
// each sent once, 5 s for its answer), the idle connection answering
// afterwards from the node's address (1/0), packets with a pod address on
// ext's link (must be 0), the table's peak (ipmasq: nat_v4 entries;
// MASQUERADE: conntrack -C in the node, sampled every second) and, under
// ipmasq, the datapath's drops for want of a port or of room, its early
// drops and pickups (a pickup is a lost pair, the idle connection's: the
// burst's flows are all UDP). Each condition runs once, whatever b.N.
//
//	go test ./testkit/e2e/ -run '^$' -bench DNSBurst -benchtime 1x -args -dns.rate=1000 -dns.duration=10s
func BenchmarkDNSBurst(b *testing.B) {
	if *flagDNSRate <= 0 || *flagDNSDuration < time.Second {
		b.Fatalf("-dns.rate=%d -dns.duration=%s: want a positive rate for at least 1s", *flagDNSRate, *flagDNSDuration)
	}
	type measured struct {
		dnsBurstResult
		leaked int
	}
	results := map[string]measured{}
	for _, resolvers := range []int{1, 2} {
		// The masqueraders one after the other for each burst, so both
		// see about the same load on the machine.
		for _, name := range []string{"MASQUERADE", "ipmasq"} {
			cond := fmt.Sprintf("%s/resolvers=%d", name, resolvers)
			b.Run(cond, func(b *testing.B) {
				// The framework calls a sub-benchmark again with a
				// larger b.N: the figures of the first call stand.
				res, ok := results[cond]
				if !ok {
					topo, a := dnsBurstTopology(b, name)
					loadBefore := loadAverage()
					leaks := watchLeaks(b, topo.Ext, "eth0", podSources...)
					res.dnsBurstResult = dnsBurst(b, topo, a, resolvers, *flagDNSRate, *flagDNSDuration, 0)
					res.leaked = leaks.count()
					b.Logf("%s, %d/s for %s to %d resolver(s): %s; %d packets with a pod address on ext's link; load average %s before, %s after",
						name, *flagDNSRate, *flagDNSDuration, resolvers, res.dnsBurstResult, res.leaked, loadBefore, loadAverage())
					if a != nil {
						b.Logf("datapath counters:\n%s", a.counters())
					}
					results[cond] = res
				}
				b.ReportMetric(float64(res.Sent), "sent")
				b.ReportMetric(float64(res.AnsweredTotal()), "answered")
				idle := 0.0
				if res.idle == nil {
					idle = 1
				}
				b.ReportMetric(idle, "idle-ok")
				b.ReportMetric(float64(res.leaked), "pod-addr-pkts")
				b.ReportMetric(float64(res.peak), "peak-entries")
				if name == "ipmasq" {
					b.ReportMetric(float64(res.noPort), "drop-no-free-port")
					b.ReportMetric(float64(res.natFull), "drop-nat-table-full")
					b.ReportMetric(float64(res.earlyDrop), "nat-early-drop")
					b.ReportMetric(float64(res.pickedUp), "nat-picked-up")
				}
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// dnsBurstTopology builds a fresh topology whose node masquerades the pod
// CIDRs with Linux MASQUERADE or with ipmasq (name "ipmasq", default
// flags but -dns.nat-max-entries), and returns ipmasq's agent (nil under
// MASQUERADE).
func dnsBurstTopology(b *testing.B, name string) (*topology.Masquerade, *agent) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { topo.Close() })
	if name == "ipmasq" {
		a := newAgent(b, topo.Node, masqueradeAll)
		if *flagDNSNATMax != 0 {
			a.args = []string{fmt.Sprintf("--nat-max-entries=%d", *flagDNSNATMax)}
		}
		a.start()
		return topo, a
	}
	for _, src := range podSources {
		v6 := netip.MustParsePrefix(src).Addr().Is6()
		if err := topo.Node.Iptables(v6, "-t", "nat", "-A", "POSTROUTING", "-s", src, "-o", "eth0", "-j", "MASQUERADE"); err != nil {
			b.Fatal(err)
		}
	}
	return topo, nil
}
