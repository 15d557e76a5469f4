package bpf

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// TestElemCountsOfEveryHashKind: the kernel's count of a map's elements
// equals a walk of it for a preallocated hash, a BPF_F_NO_PREALLOC hash
// and an LRU that evicted most of what went in.
func TestElemCountsOfEveryHashKind(t *testing.T) {
	privtest.Require(t)
	for _, c := range []struct {
		name  string
		typ   ebpf.MapType
		flags uint32
	}{{"hash", ebpf.Hash, 0}, {"hash-no-prealloc", ebpf.Hash, 1 /* BPF_F_NO_PREALLOC */}, {"lru", ebpf.LRUHash, 0}} {
		t.Run(c.name, func(t *testing.T) {
			m, err := ebpf.NewMap(&ebpf.MapSpec{Type: c.typ, KeySize: 4, ValueSize: 8, MaxEntries: 1000, Flags: c.flags})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			for i := range 5000 {
				if err := m.Put(uint32(i), uint64(i)); err != nil && c.typ != ebpf.Hash {
					t.Fatal(err)
				}
			}
			for i := range 100 {
				m.Delete(uint32(4999 - 3*i))
			}
			walk, err := CountEntries[uint32, uint64](m)
			if err != nil {
				t.Fatal(err)
			}
			id, err := mapID(m)
			if err != nil {
				t.Fatal(err)
			}
			counts, err := ElemCounts(id)
			if err != nil {
				t.Fatal(err)
			}
			if counts[id] != walk || walk == 0 {
				t.Errorf("kernel count %d, walk %d", counts[id], walk)
			}
		})
	}
}
