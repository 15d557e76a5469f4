package bpfmap

import (
	"bytes"
	"errors"
	"fmt"
	"github.com/ipmasq/ipmasq/testkit/privtest"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		if err := rlimit.RemoveMemlock(); err != nil {
			fmt.Fprintln(os.Stderr, "remove memlock rlimit:", err)
			os.Exit(1)
		}
	}
	os.Exit(m.Run())
}

// newLPMv4 creates an unpinned IPv4 LPM trie with a u8 value.
func newLPMv4(t testing.TB, maxEntries uint32) *ebpf.Map {
	t.Helper()
	privtest.Require(t)
	m, err := ebpf.NewMap(LPMTrieSpec("test_v4", 8, 1, maxEntries))
	if err != nil {
		t.Fatalf("create LPM trie: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func newCache(t testing.TB, m *ebpf.Map) *Map[LPMKeyV4, uint8] {
	t.Helper()
	c, err := NewMap[LPMKeyV4, uint8](m)
	if err != nil {
		t.Fatalf("NewMap: %v", err)
	}
	return c
}

func key4(s string) LPMKeyV4 { return LPMKeyV4From(netip.MustParsePrefix(s)) }

// prefixes returns n distinct IPv4 /24 prefixes starting at 10.0.0.0/24.
func prefixes(n int) []LPMKeyV4 {
	keys := make([]LPMKeyV4, n)
	for i := range keys {
		keys[i] = LPMKeyV4{PrefixLen: 24, Addr: [4]byte{10, byte(i >> 8), byte(i), 0}}
	}
	return keys
}

func entries(keys []LPMKeyV4, value uint8) []KV[LPMKeyV4, uint8] {
	kvs := make([]KV[LPMKeyV4, uint8], len(keys))
	for i, k := range keys {
		kvs[i] = KV[LPMKeyV4, uint8]{Key: k, Value: value}
	}
	return kvs
}

func noErrors(t testing.TB, errs []error) {
	t.Helper()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("unexpected errors: %v", err)
	}
}

// dumpEquals checks the kernel map (not the cache) holds exactly want.
func dumpEquals[K comparable, V comparable](t testing.TB, m *Map[K, V], want map[K]V) {
	t.Helper()
	got, err := m.Dump()
	if err != nil {
		t.Fatalf("Dump: %v", err)
	}
	if len(got) != len(want) {
		t.Fatalf("kernel map has %d entries, want %d:\n got %v\nwant %v", len(got), len(want), got, want)
	}
	for k, v := range want {
		if gv, ok := got[k]; !ok || gv != v {
			t.Fatalf("kernel map entry %v = %v (present %v), want %v", k, gv, ok, v)
		}
	}
}

func testLogger() (*slog.Logger, *bytes.Buffer) {
	var buf bytes.Buffer
	return slog.New(slog.NewTextHandler(&buf, nil)), &buf
}

func TestOpenPinnedCreatesAndPins(t *testing.T) {
	dir := filepath.Join(privtest.MountBPFFS(t), "ipmasq") // does not exist yet
	log, buf := testLogger()

	m, err := OpenPinned(log, dir, LPMTrieSpec("nonmasq_v4", 8, 1, 16))
	if err != nil {
		t.Fatalf("OpenPinned: %v", err)
	}
	defer m.Close()

	path := filepath.Join(dir, "nonmasq_v4")
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("map not pinned at %s: %v", path, err)
	}
	if !m.IsPinned() {
		t.Fatal("IsPinned() = false")
	}
	if m.Type() != ebpf.LPMTrie || m.MaxEntries() != 16 || m.Flags()&unix.BPF_F_NO_PREALLOC == 0 {
		t.Fatalf("unexpected layout: %s max %d flags %#x", m.Type(), m.MaxEntries(), m.Flags())
	}
	if buf.Len() != 0 {
		t.Fatalf("creating a map logged: %s", buf)
	}
}

// TestOpenPinnedRootOnly: the pin directory and pins are root-only, also
// when the umask is 0 and when an earlier run left them wider.
func TestOpenPinnedRootOnly(t *testing.T) {
	dir := filepath.Join(privtest.MountBPFFS(t), "ipmasq")
	defer syscall.Umask(syscall.Umask(0))
	spec := LPMTrieSpec("nonmasq_v4", 8, 1, 16)
	path := filepath.Join(dir, "nonmasq_v4")
	check := func(when string) {
		t.Helper()
		for p, want := range map[string]os.FileMode{dir: os.ModeDir | PinDirMode, path: PinMode} {
			fi, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode() != want {
				t.Errorf("%s: %s mode %s, want %s", when, p, fi.Mode(), want)
			}
		}
	}
	m, err := OpenPinned(nil, dir, spec)
	if err != nil {
		t.Fatalf("OpenPinned: %v", err)
	}
	m.Close()
	check("created")
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	m, err = OpenPinned(nil, dir, spec)
	if err != nil {
		t.Fatalf("OpenPinned again: %v", err)
	}
	m.Close()
	check("reopened after a chmod to 0755/0644")
}

func TestOpenPinnedReopenKeepsContents(t *testing.T) {
	dir := privtest.MountBPFFS(t)
	log, buf := testLogger()
	spec := LPMTrieSpec("nonmasq_v4", 8, 1, 16)

	m1, err := OpenPinned(log, dir, spec)
	if err != nil {
		t.Fatalf("OpenPinned: %v", err)
	}
	c1 := newCache(t, m1)
	noErrors(t, c1.Put([]KV[LPMKeyV4, uint8]{{key4("10.0.0.0/8"), 0}, {key4("192.168.0.0/16"), 1}}))
	m1.Close()

	// As after an agent restart: a new process opens the same pin.
	m2, err := OpenPinned(log, dir, spec)
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer m2.Close()
	c2 := newCache(t, m2)
	dumpEquals(t, c2, map[LPMKeyV4]uint8{key4("10.0.0.0/8"): 0, key4("192.168.0.0/16"): 1})
	if s := c2.Stats(); s.Entries != 2 {
		t.Fatalf("cache has %d entries after reopen, want 2", s.Entries)
	}
	if buf.Len() != 0 {
		t.Fatalf("reopening a compatible map logged: %s", buf)
	}
}

// TestOpenPinnedKeepIntoSmallerLRU: a hash map's entries are copied into a
// smaller LRU map up to its size, and the rest are counted as dropped (an
// LRU map would evict earlier copies instead of refusing later ones).
func TestOpenPinnedKeepIntoSmallerLRU(t *testing.T) {
	dir := privtest.MountBPFFS(t)
	log, buf := testLogger()
	old, err := OpenPinned(log, dir, &ebpf.MapSpec{Name: "nat", Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 16})
	if err != nil {
		t.Fatal(err)
	}
	want := map[uint32]uint32{}
	for k := range uint32(16) {
		if err := old.Put(k, k+100); err != nil {
			t.Fatal(err)
		}
		want[k] = k + 100
	}
	old.Close()

	m, err := OpenPinnedKeep(log, dir, &ebpf.MapSpec{Name: "nat", Type: ebpf.LRUHash, KeySize: 4, ValueSize: 4, MaxEntries: 8})
	if err != nil {
		t.Fatalf("OpenPinnedKeep: %v", err)
	}
	defer m.Close()
	if m.Type() != ebpf.LRUHash {
		t.Fatalf("type %s, want LRUHash", m.Type())
	}
	var k, v uint32
	n := 0
	for it := m.Iterate(); it.Next(&k, &v); n++ {
		if want[k] != v {
			t.Errorf("entry %d = %d, want %d", k, v, want[k])
		}
	}
	if n != 8 {
		t.Errorf("%d entries in the LRU map of 8", n)
	}
	if !strings.Contains(buf.String(), "copied=8 dropped=8") {
		t.Errorf("log does not say copied=8 dropped=8: %s", buf)
	}
}

func TestOpenPinnedReplacesIncompatible(t *testing.T) {
	for _, tc := range []struct {
		name     string
		new      *ebpf.MapSpec
		old, now string
	}{
		{"max entries", LPMTrieSpec("nonmasq_v4", 8, 1, 32), "max_entries=16", "max_entries=32"},
		{"value size", LPMTrieSpec("nonmasq_v4", 8, 4, 16), "value=1B", "value=4B"},
		{"type", &ebpf.MapSpec{Name: "nonmasq_v4", Type: ebpf.Hash, KeySize: 8, ValueSize: 1, MaxEntries: 16}, "type=LPMTrie", "type=Hash"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := privtest.MountBPFFS(t)
			log, buf := testLogger()

			old, err := OpenPinned(log, dir, LPMTrieSpec("nonmasq_v4", 8, 1, 16))
			if err != nil {
				t.Fatalf("OpenPinned: %v", err)
			}
			if err := old.Put(key4("10.0.0.0/8"), uint8(1)); err != nil {
				t.Fatalf("put: %v", err)
			}
			old.Close()

			m, err := OpenPinned(log, dir, tc.new)
			if err != nil {
				t.Fatalf("OpenPinned with new layout: %v", err)
			}
			defer m.Close()
			if err := tc.new.Compatible(m); err != nil {
				t.Fatalf("map was not replaced: %v", err)
			}
			pinned, err := ebpf.LoadPinnedMap(filepath.Join(dir, "nonmasq_v4"), nil)
			if err != nil {
				t.Fatalf("load pin: %v", err)
			}
			defer pinned.Close()
			if err := tc.new.Compatible(pinned); err != nil {
				t.Fatalf("pin still holds the old map: %v", err)
			}
			var k LPMKeyV4
			if err := m.NextKey(nil, &k); !errors.Is(err, ebpf.ErrKeyNotExist) {
				t.Fatalf("replaced map is not empty: first key %v, %v", k, err)
			}

			out := buf.String()
			for _, want := range []string{"level=WARN", filepath.Join(dir, "nonmasq_v4"), tc.old, tc.now} {
				if !strings.Contains(out, want) {
					t.Errorf("log line lacks %q:\n%s", want, out)
				}
			}
		})
	}
}

func TestOpenPinnedErrorNamesPath(t *testing.T) {
	file := filepath.Join(t.TempDir(), "not-a-dir")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := OpenPinned(nil, file, LPMTrieSpec("nonmasq_v4", 8, 1, 16))
	want := "open pinned map " + filepath.Join(file, "nonmasq_v4") + ": "
	if err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("error = %v, want prefix %q", err, want)
	}
}

func TestNewMapRejectsSizeMismatch(t *testing.T) {
	m := newLPMv4(t, 4)
	if _, err := NewMap[LPMKeyV6, uint8](m); err == nil || !strings.Contains(err.Error(), "key size") {
		t.Fatalf("NewMap with a V6 key on a V4 map: err = %v, want key size mismatch", err)
	}
	if _, err := NewMap[LPMKeyV4, uint32](m); err == nil || !strings.Contains(err.Error(), "value size") {
		t.Fatalf("NewMap with a u32 value on a u8 map: err = %v, want value size mismatch", err)
	}
}

func TestPutIdenticalMakesNoSyscall(t *testing.T) {
	c := newCache(t, newLPMv4(t, 64))
	kvs := entries(prefixes(50), 1)
	noErrors(t, c.Put(kvs))

	before := c.Stats()
	noErrors(t, c.Put(kvs))
	noErrors(t, c.Put(kvs[:1]))
	after := c.Stats()
	if after != before {
		t.Fatalf("Put of identical entries changed stats: before %+v after %+v", before, after)
	}
	if after.Writes != 50 || after.Entries != 50 {
		t.Fatalf("stats = %+v, want 50 writes and entries", after)
	}

	// Changing one value writes exactly that entry with one syscall.
	kvs[7].Value = 0
	noErrors(t, c.Put(kvs))
	if d := c.Stats(); d.Writes != 51 || d.Syscalls != after.Syscalls+1 {
		t.Fatalf("after changing one value: %+v (before %+v), want 1 write in 1 syscall", d, after)
	}
}

// Free is the capacity less what the map holds, after writes and deletes.
func TestFree(t *testing.T) {
	c := newCache(t, newLPMv4(t, 64))
	if got := c.Free(); got != 64 {
		t.Fatalf("empty map: Free %d, want 64", got)
	}
	keys := prefixes(50)
	noErrors(t, c.Put(entries(keys, 1)))
	noErrors(t, c.Delete(keys[:10]))
	if got := c.Free(); got != 24 {
		t.Fatalf("after 50 writes and 10 deletes: Free %d, want 24", got)
	}
}

func TestPut1000UsesBatch(t *testing.T) {
	c := newCache(t, newLPMv4(t, 1000))
	before := c.Stats()
	keys := prefixes(1000)
	noErrors(t, c.Put(entries(keys, 0)))
	s := c.Stats()
	if n := s.Syscalls - before.Syscalls; n != 1 {
		t.Fatalf("Put of 1000 entries made %d syscalls, want 1 batch", n)
	}
	if s.Writes != 1000 || s.Entries != 1000 {
		t.Fatalf("stats = %+v, want 1000 writes and entries", s)
	}
	want := make(map[LPMKeyV4]uint8)
	for _, k := range keys {
		want[k] = 0
	}
	dumpEquals(t, c, want)

	// Reading 1000 entries back is batched too.
	before = c.Stats()
	if err := c.Resync(); err != nil {
		t.Fatal(err)
	}
	if n := c.Stats().Syscalls - before.Syscalls; n > 2 {
		t.Fatalf("Resync of 1000 entries made %d syscalls, want batch lookups", n)
	}
}

func TestPutErrorsArePerEntry(t *testing.T) {
	c := newCache(t, newLPMv4(t, 16))
	bad := LPMKeyV4{PrefixLen: 33, Addr: [4]byte{10, 0, 0, 0}} // the kernel refuses prefixlen > 32
	kvs := []KV[LPMKeyV4, uint8]{
		{key4("10.0.0.0/8"), 0},
		{bad, 0},
		{key4("172.16.0.0/12"), 1},
	}
	errs := c.Put(kvs)
	if len(errs) != 3 {
		t.Fatalf("got %d errors for 3 entries", len(errs))
	}
	if errs[0] != nil || errs[2] != nil {
		t.Fatalf("good entries failed: %v", errs)
	}
	if !errors.Is(errs[1], unix.EINVAL) {
		t.Fatalf("bad entry error = %v, want EINVAL", errs[1])
	}
	if !strings.Contains(errs[1].Error(), "10.0.0.0/33") {
		t.Fatalf("error %q does not name the entry", errs[1])
	}
	dumpEquals(t, c, map[LPMKeyV4]uint8{key4("10.0.0.0/8"): 0, key4("172.16.0.0/12"): 1})
	if s := c.Stats(); s.Writes != 2 || s.Entries != 2 {
		t.Fatalf("stats = %+v, want 2 writes and entries", s)
	}
}

func TestPutDuplicateKeyLastWins(t *testing.T) {
	c := newCache(t, newLPMv4(t, 16))
	noErrors(t, c.Put([]KV[LPMKeyV4, uint8]{{key4("10.0.0.0/8"), 1}}))
	noErrors(t, c.Put([]KV[LPMKeyV4, uint8]{{key4("10.0.0.0/8"), 0}, {key4("10.0.0.0/8"), 1}}))
	dumpEquals(t, c, map[LPMKeyV4]uint8{key4("10.0.0.0/8"): 1})
}

func TestDelete(t *testing.T) {
	m := newLPMv4(t, 16)
	c := newCache(t, m)
	noErrors(t, c.Put(entries(prefixes(5), 1)))
	keys := prefixes(5)

	// A key that was never written costs nothing.
	before := c.Stats()
	noErrors(t, c.Delete([]LPMKeyV4{key4("192.168.0.0/16")}))
	if c.Stats() != before {
		t.Fatalf("deleting an absent key changed stats: %+v → %+v", before, c.Stats())
	}

	// A key removed behind the cache's back is not an error either, in a
	// batch or alone.
	if err := m.Delete(keys[1]); err != nil {
		t.Fatal(err)
	}
	if err := m.Delete(keys[4]); err != nil {
		t.Fatal(err)
	}
	noErrors(t, c.Delete(keys[:3]))
	noErrors(t, c.Delete(keys[4:]))
	dumpEquals(t, c, map[LPMKeyV4]uint8{keys[3]: 1})
	if s := c.Stats(); s.Deletes != 2 || s.Entries != 1 {
		t.Fatalf("stats = %+v, want 2 deletes (2 were already gone) and 1 entry", s)
	}
}

func TestResyncRepairsDrift(t *testing.T) {
	m := newLPMv4(t, 16)
	c := newCache(t, m)
	kvs := entries(prefixes(3), 1)
	noErrors(t, c.Put(kvs))

	// Someone else changes a value and deletes an entry.
	if err := m.Put(kvs[0].Key, uint8(0)); err != nil {
		t.Fatal(err)
	}
	if err := m.Delete(kvs[1].Key); err != nil {
		t.Fatal(err)
	}
	if err := c.Resync(); err != nil {
		t.Fatal(err)
	}
	writes := c.Stats().Writes
	noErrors(t, c.Put(kvs))
	if n := c.Stats().Writes - writes; n != 2 {
		t.Fatalf("Put after Resync wrote %d entries, want the 2 that drifted", n)
	}
	dumpEquals(t, c, map[LPMKeyV4]uint8{kvs[0].Key: 1, kvs[1].Key: 1, kvs[2].Key: 1})
}

// Other map types read their contents too (hash: batch lookup; array: batch
// lookup of all slots).
func TestNewMapOtherTypes(t *testing.T) {
	privtest.Require(t)
	for _, typ := range []ebpf.MapType{ebpf.Hash, ebpf.Array} {
		t.Run(typ.String(), func(t *testing.T) {
			m, err := ebpf.NewMap(&ebpf.MapSpec{Type: typ, KeySize: 4, ValueSize: 8, MaxEntries: 8})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			for i := uint32(0); i < 5; i++ {
				if err := m.Put(i, uint64(i*10)); err != nil {
					t.Fatal(err)
				}
			}
			c, err := NewMap[uint32, uint64](m)
			if err != nil {
				t.Fatal(err)
			}
			want := map[uint32]uint64{0: 0, 1: 10, 2: 20, 3: 30, 4: 40}
			if typ == ebpf.Array {
				for i := uint32(5); i < 8; i++ {
					want[i] = 0
				}
			}
			dumpEquals(t, c, want)
			if c.Stats().Entries != len(want) {
				t.Fatalf("cache has %d entries, want %d", c.Stats().Entries, len(want))
			}
			// Iteration gives the same result as the batch lookup.
			c.noBatchLookup.Store(true)
			dumpEquals(t, c, want)
		})
	}
}

// TestOpenPinnedKeepGrownValue: a map whose value layout grew by a field
// appended at its end keeps its entries: each old value is the start of
// the new one, the new field zero. A value that shrank is not copied.
func TestOpenPinnedKeepGrownValue(t *testing.T) {
	dir := privtest.MountBPFFS(t)
	log, buf := testLogger()
	old, err := OpenPinned(log, dir, &ebpf.MapSpec{Name: "nat", Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 16})
	if err != nil {
		t.Fatal(err)
	}
	for k := range uint32(4) {
		if err := old.Put(k, k+100); err != nil {
			t.Fatal(err)
		}
	}
	old.Close()

	m, err := OpenPinnedKeep(log, dir, &ebpf.MapSpec{Name: "nat", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 16})
	if err != nil {
		t.Fatalf("OpenPinnedKeep: %v", err)
	}
	var k uint32
	var v [2]uint32
	n := 0
	for it := m.Iterate(); it.Next(&k, &v); n++ {
		if v != [2]uint32{k + 100, 0} {
			t.Errorf("entry %d = %v, want [%d 0]", k, v, k+100)
		}
	}
	m.Close()
	if n != 4 {
		t.Errorf("%d entries kept, want 4", n)
	}
	if !strings.Contains(buf.String(), "copied=4 dropped=0") {
		t.Errorf("log does not say copied=4 dropped=0: %s", buf)
	}

	m, err = OpenPinnedKeep(log, dir, &ebpf.MapSpec{Name: "nat", Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 16})
	if err != nil {
		t.Fatalf("OpenPinnedKeep: %v", err)
	}
	defer m.Close()
	var v4 uint32
	if it := m.Iterate(); it.Next(&k, &v4) {
		t.Errorf("entry %d copied into a shorter value", k)
	}
}
