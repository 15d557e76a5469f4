package datapath

import (
	"errors"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// TestLoadedMap: the Handle finds the loaded datapath's maps by the names
// lib/maps.h gives them (as bpfmap.Ops asks for them), fails with
// ErrNotLoaded before the datapath is loaded and names a map it has not.
func TestLoadedMap(t *testing.T) {
	h := newHandle()
	if _, err := h.LoadedMap(bpf.MapNonMasqV4); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("before load: %v, want ErrNotLoaded", err)
	}
	privtest.Require(t)
	dp, err := bpf.Load(bpf.LoadOptions{NATMaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	h.dp.Store(dp)
	for name, want := range map[string]*ebpf.Map{
		bpf.MapNonMasqV4:   dp.Maps.NonmasqV4,
		bpf.MapNonMasqV6:   dp.Maps.NonmasqV6,
		bpf.MapMasqSrcV4:   dp.Maps.MasqSrcV4,
		bpf.MapMasqRulesV6: dp.Maps.MasqRulesV6,
		bpf.MapNodeAddrsV4: dp.Maps.NodeAddrsV4,
	} {
		if got, err := h.LoadedMap(name); err != nil || got != want {
			t.Errorf("LoadedMap(%s) = %v, %v; want %v", name, got, err, want)
		}
	}
	if _, err := h.LoadedMap("no_such_map"); err == nil || err.Error() != "the datapath has no map no_such_map" {
		t.Errorf("LoadedMap of an unknown name: %v", err)
	}
}
