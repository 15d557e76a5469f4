package natgc

import (
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/testkit/natfill"
)

// BenchmarkIdleScale: the collector's CPU for one round (one
// --nat-gc-interval, 10 s by default) over n idle answered TCP pairs (a
// minute idle: none expired), measured as the thread's user + system time
// (the batch reads and kernel judgments run in its system time), and the
// same per minute at the default interval. The figure must not grow with
// n: cpu-ms/round at 1 000 000 flows over the same at 50 000 is the
// flatness (it was 0.6 s a minute per 100 000 idle pairs: a full read and
// a lookup of the other half of every TCP pair idle over 10 s).
//
//	go test -run '^$' -bench IdleScale -benchtime 20x ./reconcilers/natgc/
func BenchmarkIdleScale(b *testing.B) {
	for _, flows := range natfill.Sizes {
		b.Run(fmt.Sprintf("flows=%d", flows), func(b *testing.B) {
			dp, _ := natfill.Datapath(b, flows, time.Minute)
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			var (
				s     scanner[bpf.NATKeyV4, bpf.NATValV4]
				cpu   time.Duration
				read  int
				ended int
			)
			for b.Loop() {
				before := threadCPU(b)
				st, err := s.round(dp.Maps.NatV4, bpf.MapNATV4, dp.EndPairV4, bpf.DefaultLifetimes,
					natfill.Now(), nil, describeV4, gcScanPerRound)
				if err != nil {
					b.Fatal(err)
				}
				cpu += threadCPU(b) - before
				read, ended = read+st.Entries, ended+st.Expired
			}
			if ended != 0 {
				b.Fatalf("ended %d idle pairs", ended)
			}
			perRound := cpu.Seconds() * 1e3 / float64(b.N)
			b.ReportMetric(perRound, "cpu-ms/round")
			b.ReportMetric(perRound*6/1e3, "cpu-s/min")
			b.ReportMetric(float64(read)/float64(b.N), "entries/round")

			// The collector before (main at 6dd7ccd): the whole map read
			// every round, and the other half of every entry idle past
			// the shortest lifetime its flags allow looked up.
			var before time.Duration
			for range 3 {
				t0 := threadCPU(b)
				fullScanWithPeerLookups(b, dp)
				before += threadCPU(b) - t0
			}
			b.ReportMetric(before.Seconds()*1e3/3, "before-cpu-ms/round")
		})
	}
}

// fullScanWithPeerLookups is the scan of the collector before bounded
// rounds (reconcilers/natgc at 6dd7ccd: collectMap, pairExpired,
// shortestLifetime), which found no candidate among idle pairs.
func fullScanWithPeerLookups(b *testing.B, dp *bpf.Datapath) {
	l := bpf.DefaultLifetimes
	now := natfill.Now()
	var (
		cursor ebpf.MapBatchCursor
		keys   = make([]bpf.NATKeyV4, gcChunk)
		vals   = make([]bpf.NATValV4, gcChunk)
		peer   bpf.NATValV4
	)
	shortest := func(proto, flags uint8) time.Duration {
		d := l.Of(bpf.StateOf(proto, flags))
		for bit := range 8 {
			d = min(d, l.Of(bpf.StateOf(proto, flags|1<<bit)))
		}
		return d
	}
	for {
		n, err := dp.Maps.NatV4.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			if age(now, vals[i].LastSeenNs) > shortest(keys[i].Proto, vals[i].Flags) {
				dp.Maps.NatV4.Lookup(bpf.PeerV4(keys[i], vals[i]), &peer)
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

func threadCPU(b *testing.B) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
