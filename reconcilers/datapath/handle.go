package datapath

import (
	"errors"
	"sync/atomic"

	"github.com/ipmasq/ipmasq/bpf"
)

// Handle is the loaded datapath, set by the start hook, for this package's
// operations and script commands. Readers outside it use bpf.Pinned.
type Handle struct{ dp atomic.Pointer[bpf.Datapath] }

func newHandle() *Handle { return &Handle{} }

func (h *Handle) get() *bpf.Datapath { return h.dp.Load() }

// ErrNotLoaded is returned before the hive has started the datapath.
var ErrNotLoaded = errors.New("datapath not loaded")
