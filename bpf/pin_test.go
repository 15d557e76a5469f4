package bpf

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// TestLoadPinsEveryMap: every map of the object is pinned under the pin
// directory, and each pin is the map the programs use, so that a map added
// in C is kept across restarts and readable through its pin without a
// change in Go; the nonmasq tries too, whose one owner is the loader.
func TestLoadPinsEveryMap(t *testing.T) {
	e := newEnv(t, envOptions{})
	spec, err := loadMasq()
	if err != nil {
		t.Fatal(err)
	}
	used := map[ebpf.MapID]bool{}
	egressL3, ingressL3, err := e.dp.ProgramsL3()
	if err != nil {
		t.Fatal(err)
	}
	for _, prog := range []*ebpf.Program{e.dp.Egress, e.dp.Ingress, egressL3, ingressL3} {
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

// TestNonMasqTriesKeptThroughResize: the loader owns nonmasq_v4/v6 like
// every other map: a restart with another --max-nonmasq-cidrs replaces the
// tries at the new size with their entries copied, so that the programs
// never see an empty config while the reconciler catches up; Pinned reads
// them back.
func TestNonMasqTriesKeptThroughResize(t *testing.T) {
	privtest.Require(t)
	pinDir := filepath.Join(privtest.MountBPFFS(t), "ipmasq")
	dp, err := Load(LoadOptions{PinDir: pinDir, NonMasqMaxEntries: 100, NATMaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	p := netip.MustParsePrefix("10.0.0.0/8")
	if err := dp.Maps.NonmasqV4.Put(LPMKeyV4From(p), uint8(0)); err != nil {
		t.Fatal(err)
	}
	dp.Close()

	dp, err = Load(LoadOptions{PinDir: pinDir, NonMasqMaxEntries: 200, NATMaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	if n := dp.Maps.NonmasqV4.MaxEntries(); n != 200 {
		t.Errorf("nonmasq_v4 holds %d entries at most, want 200", n)
	}
	got, err := (Pinned{Dir: pinDir}).NonMasq(MapNonMasqV4)
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := got[p]; len(got) != 1 || !ok || v != 0 {
		t.Errorf("the pinned nonmasq_v4 after the resize holds %v, want %s → 0", got, p)
	}
}

// TestLoadRemovesRetiredPins: a pin of a map the programs no longer use
// (left by an earlier version in the pin directory) is removed by the
// next load; the maps in use stay pinned.
func TestLoadRemovesRetiredPins(t *testing.T) {
	privtest.Require(t)
	pinDir := filepath.Join(privtest.MountBPFFS(t), "ipmasq")
	dp, err := Load(LoadOptions{PinDir: pinDir, NATMaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	dp.Close()
	for _, name := range retiredPins {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Pin(filepath.Join(pinDir, name)); err != nil {
			t.Fatal(err)
		}
		m.Close()
	}

	dp, err = Load(LoadOptions{PinDir: pinDir, NATMaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	for _, name := range retiredPins {
		if _, err := os.Stat(filepath.Join(pinDir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the retired pin %s is still there after a load (%v)", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(pinDir, MapNATV4)); err != nil {
		t.Errorf("the pin of %s: %v", MapNATV4, err)
	}
}
