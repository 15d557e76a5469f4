package bpfmap

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// BenchmarkLPMWrite compares filling an empty IPv4 LPM trie through Map.Put
// (one BatchUpdate) with one Update syscall per entry, in the same run so
// that their ratio can be reported.
//
// Each iteration needs an empty map. Maps are created in groups with the
// timer stopped, because StopTimer/StartTimer read memory statistics and
// would otherwise dominate the small cases.
func BenchmarkLPMWrite(b *testing.B) {
	privtest.Require(b)
	for _, n := range []int{10, 1000, 16384} {
		keys := prefixes(n)
		kvs := entries(keys, 0)
		b.Run(fmt.Sprintf("n=%d/batch", n), func(b *testing.B) {
			var syscalls uint64
			newCache := func(m *ebpf.Map) *Map[LPMKeyV4, uint8] {
				c, err := NewMap[LPMKeyV4, uint8](m)
				if err != nil {
					b.Fatal(err)
				}
				syscalls -= c.Stats().Syscalls // NewMap's read is not timed
				return c
			}
			forEachEmptyMap(b, n, newCache, func(c *Map[LPMKeyV4, uint8]) {
				for _, err := range c.Put(kvs) {
					if err != nil {
						b.Fatal(err)
					}
				}
				syscalls += c.Stats().Syscalls
			})
			b.ReportMetric(float64(syscalls)/float64(b.N), "syscalls/op")
		})
		b.Run(fmt.Sprintf("n=%d/update", n), func(b *testing.B) {
			forEachEmptyMap(b, n, func(m *ebpf.Map) *ebpf.Map { return m }, func(m *ebpf.Map) {
				for j := range keys {
					if err := m.Update(&keys[j], &kvs[j].Value, ebpf.UpdateAny); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.ReportMetric(float64(n), "syscalls/op")
		})
	}
}

// forEachEmptyMap calls fill b.N times, each with prepare's view of a new
// empty LPM trie of n entries. Creating, preparing and closing the maps is not
// timed.
func forEachEmptyMap[T any](b *testing.B, n int, prepare func(*ebpf.Map) T, fill func(T)) {
	group := min(256, max(1, 65536/n))
	maps := make([]*ebpf.Map, 0, group)
	views := make([]T, 0, group)
	b.ResetTimer()
	for done := 0; done < b.N; {
		b.StopTimer()
		maps, views = maps[:0], views[:0]
		for range min(group, b.N-done) {
			m, err := ebpf.NewMap(LPMTrieSpec("bench_v4", 8, 1, uint32(n)))
			if err != nil {
				b.Fatal(err)
			}
			maps = append(maps, m)
			views = append(views, prepare(m))
		}
		b.StartTimer()
		for _, v := range views {
			fill(v)
		}
		b.StopTimer()
		for _, m := range maps {
			m.Close()
		}
		done += len(maps)
		b.StartTimer()
	}
}

// BenchmarkOpsRound is a round of the nonmasq reconciler at 16 384
// prefixes through Ops, as the agent builds them (DistinctKeys): every row
// written in one batch, then every row deleted in one. Beside
// BenchmarkLPMWrite it shows what Ops adds to Map (a same-run ratio
// against an older tree's Ops says whether a change of Ops costs).
func BenchmarkOpsRound(b *testing.B) {
	privtest.Require(b)
	objs := make([]cidr, 16384)
	for i := range objs {
		objs[i] = cidr{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24)}
	}
	ops := newOps(newLPMv4(b, uint32(len(objs))), func(e *Entries[cidr, LPMKeyV4, LPMKeyV6, uint8]) { e.DistinctKeys = true })
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		batch := batchOf(objs)
		ops.UpdateBatch(ctx, nil, batch)
		ops.DeleteBatch(ctx, nil, batch)
		for _, e := range batch {
			if e.Result != nil {
				b.Fatal(e.Result)
			}
		}
	}
}
