package bpfmap

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"maps"
	"net/netip"
	"runtime"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"
)

// cidr stands in for a table row.
type cidr struct {
	Prefix netip.Prefix
	Action uint8
}

func cidrEntry(c cidr) (LPMKeyV4, uint8)  { return LPMKeyV4From(c.Prefix), c.Action }
func cidrEntry6(c cidr) (LPMKeyV6, uint8) { return LPMKeyV6From(c.Prefix), c.Action }

func rows(specs ...string) []cidr {
	out := make([]cidr, len(specs))
	for i, s := range specs {
		out[i] = cidr{Prefix: netip.MustParsePrefix(s)}
	}
	return out
}

func batchOf(objs []cidr) []reconciler.BatchEntry[cidr] {
	b := make([]reconciler.BatchEntry[cidr], len(objs))
	for i, o := range objs {
		b[i] = reconciler.BatchEntry[cidr]{Object: o, Revision: statedb.Revision(i + 1)}
	}
	return b
}

func seqOf(objs []cidr) iter.Seq2[cidr, statedb.Revision] {
	return func(yield func(cidr, statedb.Revision) bool) {
		for i, o := range objs {
			if !yield(o, statedb.Revision(i+1)) {
				return
			}
		}
	}
}

func keysOf(objs []cidr) iter.Seq[LPMKeyV4] {
	return func(yield func(LPMKeyV4) bool) {
		for _, o := range objs {
			if !yield(LPMKeyV4From(o.Prefix)) {
				return
			}
		}
	}
}

func wantOf(objs []cidr) map[LPMKeyV4]uint8 {
	want := make(map[LPMKeyV4]uint8)
	for _, o := range objs {
		k, v := cidrEntry(o)
		want[k] = v
	}
	return want
}

// table is a table's rows, as Entries.Table reads them.
type table []cidr

func (t table) All(statedb.ReadTxn) iter.Seq2[cidr, statedb.Revision] { return seqOf(t) }

// loaded are maps by name, as a datapath loader has them; a name it does
// not have is not loaded yet.
type loaded map[string]*ebpf.Map

func (l loaded) LoadedMap(name string) (*ebpf.Map, error) {
	if m, ok := l[name]; ok {
		return m, nil
	}
	return nil, fmt.Errorf("%s: not loaded", name)
}

// cidrs describes rows of both families going to the maps "m4" and "m6"
// (a family without its map in the loader is disabled).
func cidrs(l loaded) Entries[cidr, LPMKeyV4, LPMKeyV6, uint8] {
	e := Entries[cidr, LPMKeyV4, LPMKeyV6, uint8]{
		Is4:  func(c cidr) bool { return c.Prefix.Addr().Is4() },
		V4:   cidrEntry,
		V6:   cidrEntry6,
		Name: func(c cidr) string { return c.Prefix.String() },
	}
	if _, ok := l["m4"]; ok {
		e.MapV4 = "m4"
	}
	if _, ok := l["m6"]; ok {
		e.MapV6 = "m6"
	}
	return e
}

// newOps returns Ops of cidrs over an IPv4 map alone.
func newOps(m *ebpf.Map, with func(*Entries[cidr, LPMKeyV4, LPMKeyV6, uint8])) *Ops[cidr, LPMKeyV4, LPMKeyV6, uint8] {
	l := loaded{"m4": m}
	e := cidrs(l)
	if with != nil {
		with(&e)
	}
	return NewOps(l, e)
}

// opsMap is the cache the operations write through.
func opsMap(t testing.TB, ops *Ops[cidr, LPMKeyV4, LPMKeyV6, uint8]) *Map[LPMKeyV4, uint8] {
	t.Helper()
	m4, _ := ops.Maps()
	if m4 == nil {
		t.Fatal("the IPv4 map is not open")
	}
	return m4
}

func newLPMv6(t testing.TB, maxEntries uint32) *ebpf.Map {
	t.Helper()
	m, err := ebpf.NewMap(LPMTrieSpec("test_v6", 20, 1, maxEntries))
	if err != nil {
		t.Fatalf("create LPM trie: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func TestOpsUpdateAndDelete(t *testing.T) {
	ctx := context.Background()
	ops := newOps(newLPMv4(t, 16), nil)

	objs := rows("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
	batch := batchOf(objs)
	ops.UpdateBatch(ctx, nil, batch)
	for _, e := range batch {
		if e.Result != nil {
			t.Fatalf("UpdateBatch %v: %v", e.Object.Prefix, e.Result)
		}
	}
	if err := ops.Update(ctx, nil, 4, cidr{netip.MustParsePrefix("100.64.0.0/10"), 1}); err != nil {
		t.Fatalf("Update: %v", err)
	}
	c := opsMap(t, ops)
	dumpEquals(t, c, wantOf(append(slices.Clone(objs), cidr{netip.MustParsePrefix("100.64.0.0/10"), 1})))

	if err := ops.Delete(ctx, nil, 5, cidr{Prefix: netip.MustParsePrefix("100.64.0.0/10")}); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	del := batchOf(append(objs[:2:2], rows("198.18.0.0/15")...)) // the last was never added
	ops.DeleteBatch(ctx, nil, del)
	for _, e := range del {
		if e.Result != nil {
			t.Fatalf("DeleteBatch %v: %v", e.Object.Prefix, e.Result)
		}
	}
	dumpEquals(t, c, wantOf(objs[2:]))
}

func TestOpsPrune(t *testing.T) {
	ctx := context.Background()
	m := newLPMv4(t, 16)

	// What a previous agent left behind: one stale entry, one entry with
	// the wrong value, one right entry; nothing in this process's cache.
	stale := rows("192.0.2.0/24", "10.0.0.0/8", "172.16.0.0/12")
	stale[1].Action = 1
	for _, o := range stale {
		k, v := cidrEntry(o)
		if err := m.Put(k, v); err != nil {
			t.Fatal(err)
		}
	}
	ops := newOps(m, nil)
	if err := ops.Prune(ctx, nil, seqOf(stale)); err != nil { // opens the map: its cache is read
		t.Fatalf("Prune: %v", err)
	}
	c := opsMap(t, ops)
	before := c.Stats()

	desired := rows("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
	// Drift after NewMap: someone deletes a desired entry the cache knows.
	if err := m.Delete(LPMKeyV4From(desired[1].Prefix)); err != nil {
		t.Fatal(err)
	}

	if err := ops.Prune(ctx, nil, seqOf(desired)); err != nil {
		t.Fatalf("Prune: %v", err)
	}
	dumpEquals(t, c, wantOf(desired))
	s := c.Stats()
	if s.Deletes-before.Deletes != 1 || s.Writes-before.Writes != 3 {
		t.Fatalf("stats = %+v after %+v, want 1 delete (stale) and 3 writes (changed value, missing, new)", s, before)
	}

	if err := ops.Prune(ctx, nil, seqOf(desired)); err != nil {
		t.Fatalf("second Prune: %v", err)
	}
	if s2 := c.Stats(); s2.Writes != s.Writes || s2.Deletes != s.Deletes {
		t.Fatalf("second Prune changed the map: %+v → %+v", s, s2)
	}

	// Pruning to nothing empties the map without a flush.
	if err := ops.Prune(ctx, nil, seqOf(nil)); err != nil {
		t.Fatalf("Prune to empty: %v", err)
	}
	dumpEquals(t, c, map[LPMKeyV4]uint8{})
}

// A map full of stale entries (a restart with a new config, before the first
// prune) makes room for desired entries instead of dropping them.
func TestOpsMapFullEvictsUndesired(t *testing.T) {
	ctx := context.Background()
	stale := rows("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4")
	desired := rows("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")

	fill := func(t *testing.T) *ebpf.Map {
		m := newLPMv4(t, 4)
		noErrors(t, newCache(t, m).Put(entries(slices.Collect(keysOf(stale)), 0)))
		return m
	}
	wanted := func(rows []cidr) func(*Entries[cidr, LPMKeyV4, LPMKeyV6, uint8]) {
		return func(e *Entries[cidr, LPMKeyV4, LPMKeyV6, uint8]) { e.Table = table(rows) }
	}

	t.Run("UpdateBatch", func(t *testing.T) {
		ops := newOps(fill(t), wanted(desired))
		batch := batchOf(desired)
		ops.UpdateBatch(ctx, nil, batch)
		for _, e := range batch {
			if e.Result != nil {
				t.Fatalf("UpdateBatch %v: %v", e.Object.Prefix, e.Result)
			}
		}
		dumpEquals(t, opsMap(t, ops), wantOf(desired))
	})

	t.Run("Update", func(t *testing.T) {
		// Only part of the new config is desired yet: only as much is evicted.
		keep := append(slices.Clone(stale[:3]), desired[0])
		ops := newOps(fill(t), wanted(keep))
		if err := ops.Update(ctx, nil, 1, desired[0]); err != nil {
			t.Fatalf("Update: %v", err)
		}
		dumpEquals(t, opsMap(t, ops), wantOf(keep))
	})

	t.Run("without a table", func(t *testing.T) {
		ops := newOps(fill(t), nil)
		batch := batchOf(desired)
		ops.UpdateBatch(ctx, nil, batch)
		for _, e := range batch {
			if !errors.Is(e.Result, unix.ENOSPC) {
				t.Fatalf("UpdateBatch %v: %v, want ENOSPC", e.Object.Prefix, e.Result)
			}
		}
		// Nothing was lost: the map still holds what it held.
		c := opsMap(t, ops)
		dumpEquals(t, c, wantOf(stale))
		// The next prune makes room.
		if err := ops.Prune(ctx, nil, seqOf(desired)); err != nil {
			t.Fatalf("Prune: %v", err)
		}
		dumpEquals(t, c, wantOf(desired))
	})

	t.Run("more desired than fits", func(t *testing.T) {
		all := append(slices.Clone(desired), rows("198.18.0.0/15")...)
		ops := newOps(fill(t), wanted(all))
		batch := batchOf(all)
		ops.UpdateBatch(ctx, nil, batch)
		for i, e := range batch {
			if i < 4 && e.Result != nil {
				t.Fatalf("UpdateBatch %v: %v", e.Object.Prefix, e.Result)
			}
			if i == 4 && !errors.Is(e.Result, unix.ENOSPC) {
				t.Fatalf("UpdateBatch %v: %v, want ENOSPC for the entry that does not fit", e.Object.Prefix, e.Result)
			}
		}
		dumpEquals(t, opsMap(t, ops), wantOf(desired))
	})
}

// TestOpsDistinctKeys: with DistinctKeys a batch is written and removed
// as without it, and without building the map of repeated keys, a map as
// large as the batch (issue #14).
func TestOpsDistinctKeys(t *testing.T) {
	ctx := context.Background()
	const n = 4096
	objs := make([]cidr, n)
	for i := range objs {
		objs[i] = cidr{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24), Action: uint8(i % 2)}
	}
	// allocated returns the bytes allocated by f.
	allocated := func(f func()) uint64 {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		f()
		runtime.ReadMemStats(&after)
		return after.TotalAlloc - before.TotalAlloc
	}
	var written, removed [2]uint64
	for i, distinct := range []bool{false, true} {
		ops := newOps(newLPMv4(t, n), func(e *Entries[cidr, LPMKeyV4, LPMKeyV6, uint8]) { e.DistinctKeys = distinct })
		if err := ops.Prune(ctx, nil, seqOf(nil)); err != nil { // opens the map, untimed
			t.Fatal(err)
		}
		batch := batchOf(objs)
		written[i] = allocated(func() { ops.UpdateBatch(ctx, nil, batch) })
		for _, e := range batch {
			if e.Result != nil {
				t.Fatalf("distinct %v: UpdateBatch %v: %v", distinct, e.Object.Prefix, e.Result)
			}
		}
		c := opsMap(t, ops)
		got, err := c.Dump()
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(got, wantOf(objs)) {
			t.Fatalf("distinct %v: map holds %d entries, want the %d written", distinct, len(got), n)
		}
		removed[i] = allocated(func() { ops.DeleteBatch(ctx, nil, batch) })
		for _, e := range batch {
			if e.Result != nil {
				t.Fatalf("distinct %v: DeleteBatch %v: %v", distinct, e.Object.Prefix, e.Result)
			}
		}
		if got, err := c.Dump(); err != nil || len(got) != 0 {
			t.Fatalf("distinct %v: after DeleteBatch the map holds %d entries (%v)", distinct, len(got), err)
		}
	}
	// The map of repeated keys holds at least a key and an index per entry.
	const mapBytes = n * 12
	if written[1]+mapBytes > written[0] {
		t.Errorf("UpdateBatch allocated %d bytes with DistinctKeys, %d without; want at least %d fewer", written[1], written[0], mapBytes)
	}
	if removed[1]+mapBytes > removed[0] {
		t.Errorf("DeleteBatch allocated %d bytes with DistinctKeys, %d without; want at least %d fewer", removed[1], removed[0], mapBytes)
	}
}

// TestOpsFamilies: each row reaches the map of its family, in a batch of
// one family whole and in a mixed batch split by family, with each row's
// result; prune keeps each map to its family's rows.
func TestOpsFamilies(t *testing.T) {
	ctx := context.Background()
	l := loaded{"m4": newLPMv4(t, 3), "m6": newLPMv6(t, 16)}
	ops := NewOps(l, cidrs(l))
	only4 := batchOf(rows("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")) // one too many for m4
	ops.UpdateBatch(ctx, nil, only4)
	if only4[0].Result != nil || only4[1].Result != nil || only4[2].Result != nil || !errors.Is(only4[3].Result, unix.ENOSPC) {
		t.Fatalf("IPv4-only batch results %v", []error{only4[0].Result, only4[1].Result, only4[2].Result, only4[3].Result})
	}
	mixed := batchOf(rows("fd00::/8", "10.0.0.0/8", "2001:db8::/32"))
	ops.DeleteBatch(ctx, nil, mixed[1:2])
	ops.UpdateBatch(ctx, nil, mixed)
	for _, e := range mixed {
		if e.Result != nil {
			t.Fatalf("mixed batch %v: %v", e.Object.Prefix, e.Result)
		}
	}
	m4, m6 := ops.Maps()
	dumpEquals(t, m4, wantOf(rows("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")))
	want6 := map[LPMKeyV6]uint8{LPMKeyV6From(netip.MustParsePrefix("fd00::/8")): 0, LPMKeyV6From(netip.MustParsePrefix("2001:db8::/32")): 0}
	dumpEquals(t, m6, want6)

	if err := ops.Prune(ctx, nil, seqOf(rows("fd00::/8", "10.0.0.0/8"))); err != nil {
		t.Fatal(err)
	}
	dumpEquals(t, m4, wantOf(rows("10.0.0.0/8")))
	dumpEquals(t, m6, map[LPMKeyV6]uint8{LPMKeyV6From(netip.MustParsePrefix("fd00::/8")): 0})
}

// TestOpsDisabledFamily: a row of a family without a map is an error on
// update naming the row, nothing on delete; the other family is written.
func TestOpsDisabledFamily(t *testing.T) {
	ctx := context.Background()
	ops := newOps(newLPMv4(t, 16), nil)
	if err := ops.Update(ctx, nil, 0, rows("fd00::/8")[0]); err == nil || err.Error() != "fd00::/8: IPv6 is disabled, there is no map for it" {
		t.Fatalf("update of a disabled family: %v", err)
	}
	if err := ops.Delete(ctx, nil, 0, rows("fd00::/8")[0]); err != nil {
		t.Fatalf("delete of a disabled family: %v, want nil", err)
	}
	batch := batchOf(rows("fd00::/8", "10.0.0.0/8", "2001:db8::/32"))
	ops.UpdateBatch(ctx, nil, batch)
	if batch[0].Result == nil || batch[1].Result != nil || batch[2].Result == nil {
		t.Fatalf("batch results %v", []error{batch[0].Result, batch[1].Result, batch[2].Result})
	}
	ops.DeleteBatch(ctx, nil, batch)
	for _, e := range batch {
		if e.Result != nil {
			t.Fatalf("delete batch %v: %v, want nil", e.Object.Prefix, e.Result)
		}
	}
	if err := ops.Prune(ctx, nil, seqOf(rows("fd00::/8"))); err != nil {
		t.Fatalf("prune with a disabled family's row: %v", err)
	}
}

// TestOpsPruneErrorNamesMap: a failed prune says which map.
func TestOpsPruneErrorNamesMap(t *testing.T) {
	ops := newOps(newLPMv4(t, 1), nil)
	err := ops.Prune(context.Background(), nil, seqOf(rows("10.0.0.0/8", "172.16.0.0/12")))
	if err == nil || !errors.Is(err, unix.ENOSPC) || err.Error()[:len("m4: prune: ")] != "m4: prune: " {
		t.Fatalf("prune error %v, want the map's name and ENOSPC", err)
	}
}

// TestOpsOpenAtFirstSuccess: until the loader has the maps every operation
// (every entry of a batch) fails with its error; then the maps are opened
// once and every call reaches them.
func TestOpsOpenAtFirstSuccess(t *testing.T) {
	ctx := context.Background()
	l := loaded{}
	e := cidrs(loaded{"m4": nil})
	ops := NewOps(l, e)
	if err := ops.Update(ctx, nil, 1, rows("10.0.0.0/8")[0]); err == nil || err.Error() != "m4: not loaded" {
		t.Fatalf("Update before the maps: %v, want m4: not loaded", err)
	}
	batch := batchOf(rows("10.0.0.0/8", "172.16.0.0/12"))
	ops.UpdateBatch(ctx, nil, batch)
	for _, e := range batch {
		if e.Result == nil || e.Result.Error() != "m4: not loaded" {
			t.Fatalf("batch entry %v before the maps: %v", e.Object.Prefix, e.Result)
		}
	}
	if err := ops.Prune(ctx, nil, seqOf(nil)); err == nil {
		t.Fatal("Prune before the maps: no error")
	}
	if m4, _ := ops.Maps(); m4 != nil {
		t.Fatal("Maps before the maps are loaded: not nil")
	}

	l["m4"] = newLPMv4(t, 16)
	ops.UpdateBatch(ctx, nil, batch)
	if err := ops.Update(ctx, nil, 3, rows("192.168.0.0/16")[0]); err != nil {
		t.Fatal(err)
	}
	c := opsMap(t, ops)
	delete(l, "m4") // opened once: the loader is not asked again
	if err := ops.Delete(ctx, nil, 4, rows("10.0.0.0/8")[0]); err != nil {
		t.Fatal(err)
	}
	dumpEquals(t, c, wantOf(rows("172.16.0.0/12", "192.168.0.0/16")))
}
