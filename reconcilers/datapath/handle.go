package datapath

import (
	"errors"
	"fmt"
	"reflect"
	"sync/atomic"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
)

// Handle is the loaded datapath, set by Cell's start hook and cleared by
// its stop hook. It is in the hive for the reconcilers of the datapath's
// kernel objects (reconcilers/tcattach, masqrules, masqsources, nodeaddrs,
// nonmasqmaps, natgc), which get the programs and maps from it at use: they
// are created before the hive starts, the maps exist only once it has.
// Readers outside the datapath use bpf.Pinned instead.
type Handle struct{ dp atomic.Pointer[bpf.Datapath] }

func newHandle() *Handle { return &Handle{} }

// Get returns the loaded datapath, or nil before the start hook has loaded
// it (or after stop).
func (h *Handle) Get() *bpf.Datapath { return h.dp.Load() }

// ErrNotLoaded is returned before the hive has started the datapath.
var ErrNotLoaded = errors.New("datapath not loaded")

// LoadedMap returns the loaded datapath's map named name, as lib/maps.h
// names it (bpf.Map* constants), or ErrNotLoaded before the start hook has
// loaded the datapath. It makes Handle the bpfmap.Loader of the map
// reconcilers' bpfmap.Ops.
func (h *Handle) LoadedMap(name string) (*ebpf.Map, error) {
	dp := h.Get()
	if dp == nil {
		return nil, ErrNotLoaded
	}
	v := reflect.ValueOf(dp.Maps)
	for i := range v.NumField() {
		if v.Type().Field(i).Tag.Get("ebpf") == name {
			if m, ok := v.Field(i).Interface().(*ebpf.Map); ok && m != nil {
				return m, nil
			}
		}
	}
	return nil, fmt.Errorf("the datapath has no map %s", name)
}
