package bpf

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// TestLoadPinsEveryMap: every map of the object is pinned under the pin
// directory, and each pin is the map the programs use, so that a map added
// in C is kept across restarts and readable through its pin without a
// change in Go. (The nonmasq tries are pinned by OpenNonMasq, as their
// reconciler does, and passed to Load.)
func TestLoadPinsEveryMap(t *testing.T) {
	e := newEnv(t, envOptions{})
	spec, err := loadMasq()
	if err != nil {
		t.Fatal(err)
	}
	used := map[ebpf.MapID]bool{}
	for _, prog := range []*ebpf.Program{e.dp.Egress, e.dp.Ingress, e.dp.EgressL3, e.dp.IngressL3} {
		info, err := prog.Info()
		if err != nil {
			t.Fatal(err)
		}
		ids, ok := info.MapIDs()
		if !ok {
			t.Fatal("the kernel does not report a program's map IDs")
		}
		for _, id := range ids {
			used[id] = true
		}
	}
	checked := 0
	for name := range spec.Maps {
		if strings.HasPrefix(name, ".") {
			continue // global variables: set by the loader, held by the programs
		}
		checked++
		m, err := ebpf.LoadPinnedMap(filepath.Join(e.pinDir, name), nil)
		if err != nil {
			t.Errorf("map %s of the object is not pinned: %v", name, err)
			continue
		}
		info, err := m.Info()
		m.Close()
		if err != nil {
			t.Fatal(err)
		}
		if id, _ := info.ID(); !used[id] {
			t.Errorf("the pin of %s (map ID %d) is not a map the programs use", name, id)
		}
	}
	if checked == 0 {
		t.Fatal("the object has no maps")
	}
}
