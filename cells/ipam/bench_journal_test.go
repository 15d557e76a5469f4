package ipam

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

// BenchmarkAdd records one allocation on a store of 100 endpoints: one
// appended line and one fdatasync. Compaction is left to the caller, as
// IPAM does it in the background.
func BenchmarkAdd(b *testing.B) {
	s := newStore(b)
	if _, _, err := s.Load(); err != nil {
		b.Fatal(err)
	}
	ip := netip.MustParseAddr("10.244.0.1")
	for i := range 100 {
		if err := s.Add(&tables.Endpoint{IP: ip, Owner: fmt.Sprintf("resident-%d", i), Created: t0}); err != nil {
			b.Fatal(err)
		}
		ip = ip.Next()
	}
	lat := make([]time.Duration, 0, b.N)
	for b.Loop() {
		start := time.Now()
		if err := s.Add(&tables.Endpoint{IP: ip, Owner: "bench", RouteTable: 11, Created: t0}); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		if err := s.Delete(ip); err != nil {
			b.Fatal(err)
		}
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}
