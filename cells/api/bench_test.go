package api_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cells/api"
)

// BenchmarkAllocate measures one allocation on a node that already holds
// 100 endpoints, over the unix socket (what a CNI plugin sees), and
// reports the median and 99th percentile. Each allocation is durable (the
// state file is fsynced) before the answer; releases between iterations
// are not timed.
func BenchmarkAllocate(b *testing.B) {
	n := newNodeWithConfig(b, "nonMasqueradeCIDRs: [10.0.0.0/8]\n", []string{"10.244.0.0/16"})
	ctx := context.Background()
	for i := range 100 {
		if _, err := n.client.Allocate(ctx, api.AllocationRequest{Owner: fmt.Sprintf("resident-%d", i), Family: "ipv4"}); err != nil {
			b.Fatal(err)
		}
	}
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		a, err := n.client.Allocate(ctx, api.AllocationRequest{Owner: "bench", Family: "ipv4", RouteTable: ptr(uint32(11))})
		lat = append(lat, time.Since(start))
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if err := n.client.Release(ctx, a.IP); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}
