package bpf

import (
	"encoding/binary"
	"fmt"
	"io"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// elemCounter is the bpf_map iterator of mapcount.c, loaded once per
// process on first use.
var elemCounter struct {
	once sync.Once
	objs mapcountObjects
	link *link.Iter
	err  error
	mu   sync.Mutex // one session at a time
}

// ElemCounts returns the kernel's count of the elements of each map of
// ids (map->elem_count, kept by every kind of hash map on each insert,
// delete and LRU eviction, summed over CPUs by bpf_map_sum_elem_count):
// one pass over the system's maps, whatever they hold. A map the kernel
// does not count (not a hash map) reads 0.
func ElemCounts(ids ...ebpf.MapID) (map[ebpf.MapID]int, error) {
	c := &elemCounter
	c.once.Do(func() {
		if c.err = loadMapcountObjects(&c.objs, nil); c.err != nil {
			c.err = fmt.Errorf("load the map element counter (mapcount.c, kernel 6.6 or later): %w", c.err)
			return
		}
		c.link, c.err = link.AttachIter(link.IterOptions{Program: c.objs.MapElemCounts})
		if c.err != nil {
			c.err = fmt.Errorf("attach the map element counter: %w", c.err)
		}
	})
	if c.err != nil {
		return nil, c.err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	r, err := c.link.Open()
	if err != nil {
		return nil, fmt.Errorf("read the map element counter: %w", err)
	}
	defer r.Close()
	buf, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("read the map element counter: %w", err)
	}
	want := map[ebpf.MapID]bool{}
	for _, id := range ids {
		want[id] = true
	}
	out := map[ebpf.MapID]int{}
	for i := 0; i+16 <= len(buf); i += 16 {
		id := ebpf.MapID(binary.LittleEndian.Uint64(buf[i:]))
		if want[id] {
			out[id] = int(int64(binary.LittleEndian.Uint64(buf[i+8:])))
		}
	}
	return out, nil
}

// mapID is m's ID.
func mapID(m *ebpf.Map) (ebpf.MapID, error) {
	info, err := m.Info()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", m, err)
	}
	id, ok := info.ID()
	if !ok {
		return 0, fmt.Errorf("%s: the kernel gives no map ID", m)
	}
	return id, nil
}
