package datapath

import (
	"errors"
	"sync/atomic"

	"github.com/ipmasq/ipmasq/bpf"
)

// Handle is the loaded datapath, set by Cell's start hook and cleared by
// its stop hook. It is in the hive for the reconcilers of the datapath's
// kernel objects (reconcilers/tcattach, masqrules, masqsources, nodeaddrs,
// natgc), which get the programs and maps from it at use: they are created
// before the hive starts, the maps exist only once it has. Readers outside
// the datapath use bpf.Pinned instead.
type Handle struct{ dp atomic.Pointer[bpf.Datapath] }

func newHandle() *Handle { return &Handle{} }

// Get returns the loaded datapath, or nil before the start hook has loaded
// it (or after stop).
func (h *Handle) Get() *bpf.Datapath { return h.dp.Load() }

// ErrNotLoaded is returned before the hive has started the datapath.
var ErrNotLoaded = errors.New("datapath not loaded")
