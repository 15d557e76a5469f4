package metrics

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipmasq/ipmasq/testkit/natfill"
	"github.com/ipmasq/ipmasq/testkit/netnstest"
)

// BenchmarkScrapeScale: a scrape of the datapath metrics (counters,
// per-device outcomes, NAT fill and pairs, unmasqueraded flows) over the
// pins of a datapath holding n idle pairs, against what node_exporter's
// conntrack collector reads for conntrack (nf_conntrack_count and
// nf_conntrack_max) in a namespace with n entries, alternated in the same
// run. The collector reads the pins through a Cached bpf.Pinned, as the
// agent's does; the first scrape (which also loads the element counter,
// once per process) is timed alone, outside the comparison:
// first-scrape-ms. B/op is the scrape's allocation (it was a copy of the
// reply entries: 39-114 MiB of RSS at 500 000 pairs).
//
//	go test -run '^$' -bench ScrapeScale -benchtime 20x ./readers/metrics/
func BenchmarkScrapeScale(b *testing.B) {
	for _, flows := range natfill.Sizes {
		b.Run(fmt.Sprintf("flows=%d", flows), func(b *testing.B) {
			_, src := natfill.Datapath(b, flows, time.Minute)
			ns, entries := natfill.Conntrack(b, flows)
			pinned := src.Cached()
			b.Cleanup(func() { pinned.Close() })
			reg := prometheus.NewRegistry()
			reg.MustRegister(&datapathCollector{src: pinned})
			start := time.Now()
			if _, err := reg.Gather(); err != nil {
				b.Fatal(err)
			}
			first := time.Since(start)
			b.ReportAllocs()
			natfill.Compare(b, flows, entries, false,
				func() error { _, err := reg.Gather(); return err },
				func() error {
					return netnstest.Do(ns, func() error {
						for _, f := range []string{"nf_conntrack_count", "nf_conntrack_max"} {
							if _, err := os.ReadFile("/proc/sys/net/netfilter/" + f); err != nil {
								return err
							}
						}
						return nil
					})
				})
			// After the loop, which resets the metrics reported before it.
			b.ReportMetric(first.Seconds()*1e3, "first-scrape-ms")
		})
	}
}
