package e2e

import (
	"flag"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/internal/topology"
)

var (
	flagDestRates = flag.String("conntrack.rates", "300",
		"BenchmarkPerDestinationRate: new connections per second to try, comma-separated")
	flagDestDuration = flag.Duration("conntrack.duration", 150*time.Second,
		"BenchmarkPerDestinationRate: how long each rate is sustained")
)

// BenchmarkPerDestinationRate: a pod opens short TCP connections to one
// server address and port at a fixed rate for a long time (150 s by
// default, issue #11's figure), client closing first and server closing
// first, under Linux MASQUERADE and under ipmasq with default flags, in the
// same run. Reported per condition: connections that succeeded and failed.
// The highest rate with 0 failures is the figure in
// docs/datapath-benchmarks.md.
//
//	go test ./internal/e2e/ -run '^$' -bench PerDestinationRate -conntrack.rates=300,1000
func BenchmarkPerDestinationRate(b *testing.B) {
	var rates []int
	for _, s := range strings.Split(*flagDestRates, ",") {
		r, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || r <= 0 {
			b.Fatalf("-conntrack.rates=%q: want positive integers", *flagDestRates)
		}
		rates = append(rates, r)
	}
	for _, name := range []string{"MASQUERADE", "ipmasq"} {
		for _, closer := range []byte{topology.ClientClosesFirst, topology.ServerClosesFirst} {
			for _, rate := range rates {
				b.Run(fmt.Sprintf("%s/%s-closes/rate=%d", name, closerName(closer), rate), func(b *testing.B) {
					topo, err := topology.NewMasquerade()
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { topo.Close() })
					if name == "ipmasq" {
						a := newAgent(b, topo.Node, masqueradeAll)
						a.start()
					} else if err := topology.LinuxMasquerade(topo.Node, "eth0", podSources...); err != nil {
						b.Fatal(err)
					}
					l, err := topology.ServeShort(topo.Ext, shortPort)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { l.Close() })
					var res topology.RateResult
					for range b.N {
						res = topology.ConnectAtRate(topo.Pod, netip.AddrPortFrom(topology.RemoteIP4, shortPort),
							rate, *flagDestDuration, 5*time.Second, closer)
					}
					b.Logf("%s, %d/s for %s, %s closes first: %s", name, rate, *flagDestDuration, closerName(closer), res)
					b.ReportMetric(float64(res.OK), "ok")
					b.ReportMetric(float64(res.Failed), "failed")
					b.ReportMetric(0, "ns/op")
				})
			}
		}
	}
}
