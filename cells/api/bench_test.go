package api_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/tables"
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
		if _, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: fmt.Sprintf("resident-%d", i), Family: "ipv4"}); err != nil {
			b.Fatal(err)
		}
	}
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		a, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "bench", Family: "ipv4", RouteTable: ptr(uint32(11))})
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

// BenchmarkAllocateCIDRs measures allocations with the seed config and with
// 16 384 CIDRs per family, each answer carrying its family's list, on a
// node holding 100 endpoints: over the unix socket, and, interleaved in the
// same run, the same allocation in process (ipam.Allocate: the table
// transaction, the durable journal line and the CIDR read from the table,
// without HTTP and encoding). It reports p50 and p99 of both and the ratio
// of the p99s (issue #14: socket p99 < 1 ms seed, < 5 ms at 16 384).
func BenchmarkAllocateCIDRs(b *testing.B) {
	var large strings.Builder
	large.WriteString(`{"masqLinkLocal": true, "masqLinkLocalIPv6": true, "nonMasqueradeCIDRs": ["10.128.0.0/24"`)
	for i := 1; i < 16384; i++ {
		fmt.Fprintf(&large, `, "10.%d.%d.0/24", "2001:db8:1:%x::/64"`, 128+i>>8, i&0xff, i)
	}
	large.WriteString(`, "2001:db8:1::/64"]}`)
	for _, c := range []struct {
		name, config string
		cidrs        int // IPv4 CIDRs in each answer
	}{
		{"config=seed", "nonMasqueradeCIDRs: [10.0.0.0/8]\n", 2}, // and 169.254.0.0/16
		{"cidrs=16384", large.String(), 16384},
	} {
		b.Run(c.name, func(b *testing.B) {
			nd := newNodeWithConfig(b, c.config, []string{"10.244.0.0/16"})
			ctx := context.Background()
			for i := range 100 {
				if _, err := nd.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: fmt.Sprintf("resident-%d", i), Family: "ipv4"}); err != nil {
					b.Fatal(err)
				}
			}
			// A p99 needs enough samples whatever -benchtime says (make
			// bench runs 20x).
			samples := max(b.N, 300)
			var socket, inProc []time.Duration
			b.ResetTimer()
			for i := 0; i < samples; i++ {
				start := time.Now()
				a, err := nd.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "bench", Family: "ipv4"})
				socket = append(socket, time.Since(start))
				if err != nil {
					b.Fatal(err)
				}
				if len(a.NonMasqueradeCIDRs) != c.cidrs {
					b.Fatalf("answer carries %d CIDRs, want %d", len(a.NonMasqueradeCIDRs), c.cidrs)
				}
				b.StopTimer()
				if err := nd.client.Release(ctx, a.IP); err != nil {
					b.Fatal(err)
				}
				start = time.Now()
				ia, err := nd.ipam.Allocate(ctx, ipam.Request{Owner: "bench-in-process", Family: tables.IPv4})
				inProc = append(inProc, time.Since(start))
				if err != nil {
					b.Fatal(err)
				}
				if _, err := nd.ipam.Release(ia.Endpoint.IP); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.StopTimer()
			slices.Sort(socket)
			slices.Sort(inProc)
			p99 := func(l []time.Duration) time.Duration { return l[len(l)*99/100] }
			b.ReportMetric(ms(socket[len(socket)/2]), "p50-ms")
			b.ReportMetric(ms(p99(socket)), "p99-ms")
			b.ReportMetric(ms(inProc[len(inProc)/2]), "in-process-p50-ms")
			b.ReportMetric(ms(p99(inProc)), "in-process-p99-ms")
			b.ReportMetric(float64(p99(socket))/float64(p99(inProc)), "p99/in-process")
			b.ReportMetric(0, "ns/op") // samples, not b.N, allocations were made
		})
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
