package bpf

import (
	"encoding/binary"
	"fmt"
	"reflect"
	"testing"

	"github.com/cilium/ebpf"
)

// The NAT-related maps' kinds, measured (docs/datapath.md "Map kinds"):
// a preallocated hash (every element allocated when the map is made), a
// hash with BPF_F_NO_PREALLOC (elements allocated as they go in, from the
// BPF memory allocator's per-CPU caches) and an LRU (preallocated, and
// evicting its least recently used element when full).
var mapKinds = []struct {
	name string
	set  func(*ebpf.MapSpec)
}{
	{"hash", func(s *ebpf.MapSpec) { s.Type, s.Flags = ebpf.Hash, 0 }},
	{"hash-no-prealloc", func(s *ebpf.MapSpec) { s.Type, s.Flags = ebpf.Hash, 1 /* BPF_F_NO_PREALLOC */ }},
	{"lru", func(s *ebpf.MapSpec) { s.Type, s.Flags = ebpf.LRUHash, 0 }},
}

// BenchmarkNATMapKinds: per packet, a new flow (a NAT pair's two inserts)
// and an established flow's packet (lookups) with nat_v4/v6 of each kind.
//
//	go test -run '^$' -bench NATMapKinds -benchtime 200000x ./bpf/
func BenchmarkNATMapKinds(b *testing.B) {
	for _, k := range mapKinds {
		b.Run(k.name+"/new-flow", func(b *testing.B) {
			const chunk = 4096
			benchNewFlow(b, newEnv(b, envOptions{natMax: 4 * chunk, portMin: 1024, portMax: 65535, natMapKind: k.set}), chunk)
		})
		b.Run(k.name+"/established", func(b *testing.B) {
			e := newEnv(b, envOptions{natMapKind: k.set})
			f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpACK, payload: make([]byte, 1400)}
			pingPong(b, e, f)
			runBench(b, e.dp.Egress, f.packet(), b.N)
		})
	}
}

// BenchmarkNATMapMemory: the kernel memory (the map's memlock, as bpftool
// shows it) of each NAT-related map of lib/maps.h in each kind, empty,
// with 50 000 flows (100 000 entries of a NAT map, 50 000 records of the
// others, or full if smaller) and full, at the sizes of the agent's
// default 524 288-entry NAT maps.
//
//	go test -run '^$' -bench NATMapMemory -benchtime 1x ./bpf/
func BenchmarkNATMapMemory(b *testing.B) {
	spec, err := loadMasq()
	if err != nil {
		b.Fatal(err)
	}
	const natEntries = 524288
	sizes := map[string]uint32{MapNATV4: natEntries, MapNATV6: natEntries,
		MapUnmasqV4: UnmasqEntries(natEntries), MapUnmasqV6: UnmasqEntries(natEntries)}
	for _, name := range []string{MapNATV4, MapNATV6, MapUnmasqV4, MapUnmasqV6, "nat_fin_v4", "nat_fin_v6", MapFragV4, MapFragV6} {
		for _, k := range mapKinds {
			b.Run(fmt.Sprintf("%s/%s", name, k.name), func(b *testing.B) {
				s := spec.Maps[name].Copy()
				if n, ok := sizes[name]; ok {
					s.MaxEntries = n
				}
				k.set(s)
				s.Pinning = ebpf.PinNone
				mid := 50_000
				if name == MapNATV4 || name == MapNATV6 {
					mid = 100_000 // two entries a flow
				}
				mid = min(mid, int(s.MaxEntries))
				// Measured once, whatever b.N: the figures do not vary
				// between runs, filling a map does.
				var mib [3]float64
				m, err := ebpf.NewMap(s)
				if err != nil {
					b.Fatal(err)
				}
				mib[0] = memlockMiB(b, m)
				fill(b, m, 0, mid)
				mib[1] = memlockMiB(b, m)
				fill(b, m, mid, int(s.MaxEntries))
				mib[2] = memlockMiB(b, m)
				m.Close()
				for b.Loop() {
				}
				b.ReportMetric(float64(s.MaxEntries), "entries")
				b.ReportMetric(mib[0], "MiB-empty")
				b.ReportMetric(mib[1], "MiB-50k-flows")
				b.ReportMetric(mib[2], "MiB-full")
			})
		}
	}
}

// fill puts elements from..to-1 into m, each key the index in its first
// bytes, in batches.
func fill(b *testing.B, m *ebpf.Map, from, to int) {
	ks, vs := int(m.KeySize()), int(m.ValueSize())
	const chunk = 8192
	for i := from; i < to; i += chunk {
		n := min(chunk, to-i)
		keys := reflect.MakeSlice(reflect.SliceOf(reflect.ArrayOf(ks, reflect.TypeFor[byte]())), n, n)
		vals := reflect.MakeSlice(reflect.SliceOf(reflect.ArrayOf(vs, reflect.TypeFor[byte]())), n, n)
		for j := range n {
			binary.LittleEndian.PutUint32(keys.Index(j).Slice(0, ks).Bytes(), uint32(i+j)+1)
		}
		if _, err := m.BatchUpdate(keys.Interface(), vals.Interface(), nil); err != nil {
			b.Fatalf("fill %s: %v", m, err)
		}
	}
}

func memlockMiB(b *testing.B, m *ebpf.Map) float64 {
	info, err := m.Info()
	if err != nil {
		b.Fatal(err)
	}
	n, ok := info.Memlock()
	if !ok {
		b.Fatal("the kernel reports no memlock")
	}
	return float64(n) / (1 << 20)
}
