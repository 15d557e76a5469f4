package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
)

// TestCachedPinnedFollowsThePins: a Cached Pinned reads the maps it opened
// until their pins change: a resize (a new nat_v4 pinned) is read at the
// next call, a pin removed is ErrNotPinned, a new pin directory is read,
// and it lets go of the maps whose pins changed or went, and of every map
// at Close.
func TestCachedPinnedFollowsThePins(t *testing.T) {
	e := newEnv(t, envOptions{natMax: 64})
	e.egress(flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}.packet())
	p := Pinned{Dir: e.pinDir}.Cached()
	defer p.Close()
	fill := func() []NATMapFill {
		t.Helper()
		f, err := p.NATFill()
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	if f := fill(); f[0].Capacity != 64 || f[0].Entries != 2 {
		t.Fatalf("fill %+v, want 2 of 64 entries in nat_v4", f)
	}
	// The map the cache holds now, to check it is closed later.
	oldID := idOfPin(t, e.pinDir, MapNATV4)
	if !cacheHolds(p, oldID) {
		t.Fatalf("the cache does not hold nat_v4 (ID %d) after reading it", oldID)
	}

	dp, err := Load(LoadOptions{PinDir: e.pinDir, NATMaxEntries: 4096})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	e.dp.Close()
	e.dp = dp
	if f := fill(); f[0].Capacity != 4096 || f[0].Entries != 2 {
		t.Fatalf("after the resize: fill %+v, want 2 of 4096 entries in nat_v4", f)
	}
	if cacheHolds(p, oldID) {
		t.Errorf("the cache still holds the resized-away nat_v4 (ID %d) after reading the new one", oldID)
	}

	if _, err := p.Counters(); err != nil {
		t.Fatal(err)
	}
	countersID := idOfPin(t, e.pinDir, MapCounters)
	if err := os.Remove(filepath.Join(e.pinDir, MapCounters)); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Counters(); !errors.Is(err, ErrNotPinned) {
		t.Errorf("counters unpinned: got %v, want ErrNotPinned", err)
	}
	// The datapath still holds the unpinned map: the cache must not.
	if cacheHolds(p, countersID) {
		t.Errorf("the cache still holds counters (ID %d) after its pin was removed", countersID)
	}

	newID := idOfPin(t, e.pinDir, MapNATV4)
	if !cacheHolds(p, newID) {
		t.Fatalf("the cache does not hold nat_v4 (ID %d) after reading it", newID)
	}
	p.Close()
	if cacheHolds(p, newID) {
		t.Errorf("the cache holds nat_v4 (ID %d) after Close", newID)
	}
	if f := fill(); f[0].Capacity != 4096 {
		t.Fatalf("after Close: fill %+v, want a capacity of 4096", f)
	}

	// A read under way keeps its map open when another call finds the pin
	// gone; the map is let go of when that read ends.
	v6ID := idOfPin(t, e.pinDir, MapNATV6)
	m, err := p.open(MapNATV6)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(e.pinDir, MapNATV6)); err != nil {
		t.Fatal(err)
	}
	if _, err := p.NATFill(); !errors.Is(err, ErrNotPinned) {
		t.Errorf("nat_v6 unpinned: got %v, want ErrNotPinned", err)
	}
	if _, err := mapID(m); err != nil {
		t.Errorf("nat_v6 closed under a read: %v", err)
	}
	p.release(m)
	if cacheHolds(p, v6ID) {
		t.Errorf("the cache holds nat_v6 (ID %d) after its pin went and its read ended", v6ID)
	}

	// The pin directory itself replaced (the cache keeps it open): the
	// maps of the new one are read.
	if err := os.RemoveAll(e.pinDir); err != nil {
		t.Fatal(err)
	}
	dp2, err := Load(LoadOptions{PinDir: e.pinDir, NATMaxEntries: 8192})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp2.Close() })
	if f := fill(); f[0].Capacity != 8192 || f[0].Entries != 0 {
		t.Errorf("a new pin directory: fill %+v, want 0 of 8192 entries in nat_v4", f)
	}
}

func idOfPin(t *testing.T, dir, name string) ebpf.MapID {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	id, err := mapID(m)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// cacheHolds says whether p's cache holds an open map of that ID.
func cacheHolds(p Pinned, id ebpf.MapID) bool {
	p.cache.mu.Lock()
	defer p.cache.mu.Unlock()
	for m := range p.cache.held {
		if got, err := mapID(m); err == nil && got == id {
			return true
		}
	}
	return false
}
