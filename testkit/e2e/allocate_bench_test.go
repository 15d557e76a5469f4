package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
)

// allocateSamples is how many allocations BenchmarkAgentAllocate times,
// whatever b.N: a p99 needs enough of them (make bench runs 20x), and
// 1 000 puts ten samples above it instead of three.
const allocateSamples = 1000

// BenchmarkAgentAllocate measures issue #14's row "IPAM allocation over
// the socket, p99, seed config" from outside the agent: the real
// ipmasq-agent binary in its node namespace, with the seed config and 100
// resident allocations, answers allocateSamples allocations made with
// ipamapi.Client over its socket (each released again, untimed).
//
// Its same-run baseline is the durability floor: an allocation is
// answered only after its journal line is fdatasynced, so interleaved with
// the allocations the benchmark appends a line of the same length to a
// file in the agent's state directory and fdatasyncs it, as many times.
// The ratio of the p99s says how much the API, IPAM and scheduling add to
// the disk. The work happens once, whatever b.N.
func BenchmarkAgentAllocate(b *testing.B) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		b.Fatal(err)
	}
	defer topo.Close()
	a := newAgent(b, topo.Node, "nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	// The agent's default level, as on a node (the helper's is debug).
	a.args = []string{"--log-level=info"}
	a.start()
	defer a.stop(syscall.SIGTERM)
	loadBefore := loadAverage()

	ctx := context.Background()
	c := ipamapi.NewClient(filepath.Join(a.dir, "api.sock"))
	for i := range 100 {
		if _, err := c.Allocate(ctx, ipamapi.AllocationRequest{Owner: fmt.Sprintf("resident-%d/eth0", i), Family: "ipv4"}); err != nil {
			b.Fatalf("resident allocation %d: %v", i, err)
		}
	}
	// One allocation, to learn the length of the line the agent journals
	// for it.
	req := ipamapi.AllocationRequest{Owner: "bench/eth0", Family: "ipv4"}
	first, err := c.Allocate(ctx, req)
	if err != nil {
		b.Fatal(err)
	}
	if err := c.Release(ctx, first.IP); err != nil {
		b.Fatal(err)
	}
	line := journaledAdd(b, filepath.Join(a.dir, "state", "endpoints.journal"), first.IP.String())

	floor, err := os.OpenFile(filepath.Join(a.dir, "state", "fdatasync-baseline"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		b.Fatal(err)
	}
	defer floor.Close()

	alloc := make([]time.Duration, 0, allocateSamples)
	disk := make([]time.Duration, 0, allocateSamples)
	for i := range allocateSamples {
		start := time.Now()
		got, err := c.Allocate(ctx, req)
		alloc = append(alloc, time.Since(start))
		if err != nil {
			b.Fatalf("allocation %d: %v", i, err)
		}
		if want := []string{"10.0.0.0/8", "169.254.0.0/16"}; fmt.Sprint(got.NonMasqueradeCIDRs) != fmt.Sprint(want) {
			b.Fatalf("allocation %d carries %v, want %v", i, got.NonMasqueradeCIDRs, want)
		}
		if err := c.Release(ctx, got.IP); err != nil {
			b.Fatalf("release %d: %v", i, err)
		}
		start = time.Now()
		if _, err := floor.Write(line); err != nil {
			b.Fatal(err)
		}
		if err := syscall.Fdatasync(int(floor.Fd())); err != nil {
			b.Fatal(err)
		}
		disk = append(disk, time.Since(start))
	}
	loadAfter := loadAverage()
	allocP50, allocP99 := percentiles(alloc)
	diskP50, diskP99 := percentiles(disk)
	b.Logf("%d allocations: p50 %v p99 %v max %v; %d-byte append + fdatasync: p50 %v p99 %v; load average %s before, %s after",
		allocateSamples, allocP50, allocP99, alloc[len(alloc)-1], len(line), diskP50, diskP99, loadBefore, loadAfter)
	b.Run("config=seed", func(b *testing.B) {
		b.ReportMetric(ms(allocP50), "alloc-p50-ms")
		b.ReportMetric(ms(allocP99), "alloc-p99-ms")
		b.ReportMetric(ms(diskP50), "fdatasync-p50-ms")
		b.ReportMetric(ms(diskP99), "fdatasync-p99-ms")
		b.ReportMetric(float64(allocP99)/float64(diskP99), "p99/fdatasync")
		b.ReportMetric(0, "ns/op") // allocateSamples, not b.N, allocations were made
	})
}

// journaledAdd returns the journal line (newline included) that recorded
// the allocation of ip, for a baseline write of the same length.
func journaledAdd(b *testing.B, journal, ip string) []byte {
	b.Helper()
	data, err := os.ReadFile(journal)
	if err != nil {
		b.Fatal(err)
	}
	for l := range bytes.Lines(data) {
		if bytes.Contains(l, []byte(`"op":"add"`)) && bytes.Contains(l, []byte(`"ip":"`+ip+`"`)) {
			return l
		}
	}
	b.Fatalf("%s has no add record for %s:\n%s", journal, ip, data)
	return nil
}

// loadAverage is the first three fields of /proc/loadavg.
func loadAverage() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	return strings.Join(strings.Fields(string(data))[:3], " ")
}

// ms is d in milliseconds, for b.ReportMetric.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// percentiles sorts l and returns its median and 99th percentile.
func percentiles(l []time.Duration) (p50, p99 time.Duration) {
	slices.Sort(l)
	return l[len(l)/2], l[len(l)*99/100]
}
