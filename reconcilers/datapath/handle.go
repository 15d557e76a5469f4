package datapath

import (
	"errors"
	"sync/atomic"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
)

// Handle gives other cells (metrics, status) read access to the running
// datapath: its counters and NAT occupancy.
type Handle struct{ dp atomic.Pointer[bpf.Datapath] }

func newHandle() *Handle { return &Handle{} }

func (h *Handle) get() *bpf.Datapath { return h.dp.Load() }

// ErrNotLoaded is returned before the hive has started the datapath.
var ErrNotLoaded = errors.New("datapath not loaded")

// Counters returns the datapath counters summed over CPUs, indexed by
// bpf.Counter.
func (h *Handle) Counters() ([]uint64, error) {
	dp := h.get()
	if dp == nil {
		return nil, ErrNotLoaded
	}
	return bpf.ReadCounters(dp.Maps.Counters)
}

// NATOccupancy returns the entries in the IPv4 and IPv6 NAT maps and the
// capacity of each (two entries per flow).
func (h *Handle) NATOccupancy() (v4, v6, capacity int, err error) {
	dp := h.get()
	if dp == nil {
		return 0, 0, 0, ErrNotLoaded
	}
	if v4, err = countEntries[bpf.NATKeyV4, bpf.NATValV4](dp.Maps.NatV4); err != nil {
		return 0, 0, 0, err
	}
	if v6, err = countEntries[bpf.NATKeyV6, bpf.NATValV6](dp.Maps.NatV6); err != nil {
		return 0, 0, 0, err
	}
	return v4, v6, int(dp.Maps.NatV4.MaxEntries()), nil
}

// countEntries counts a map's entries (batch reads where the kernel has them).
func countEntries[K, V comparable](m *ebpf.Map) (int, error) {
	bm, err := bpfmap.NewMap[K, V](m)
	if err != nil {
		return 0, err
	}
	return bm.Stats().Entries, nil
}
