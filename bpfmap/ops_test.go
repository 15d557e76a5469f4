package bpfmap

import (
	"context"
	"errors"
	"iter"
	"maps"
	"net/netip"
	"runtime"
	"slices"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"
)

// cidr stands in for a table row.
type cidr struct {
	Prefix netip.Prefix
	Action uint8
}

func cidrEntry(c cidr) (LPMKeyV4, uint8) { return LPMKeyV4From(c.Prefix), c.Action }

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

func TestOpsUpdateAndDelete(t *testing.T) {
	ctx := context.Background()
	c := newCache(t, newLPMv4(t, 16))
	ops := NewOps(c, cidrEntry)

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
	c := newCache(t, m)
	ops := NewOps(c, cidrEntry)

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
	if s.Deletes != 1 || s.Writes != 3 {
		t.Fatalf("stats = %+v, want 1 delete (stale) and 3 writes (changed value, missing, new)", s)
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

	fill := func(t *testing.T) *Map[LPMKeyV4, uint8] {
		c := newCache(t, newLPMv4(t, 4))
		noErrors(t, c.Put(entries(slices.Collect(keysOf(stale)), 0)))
		return c
	}

	t.Run("UpdateBatch", func(t *testing.T) {
		c := fill(t)
		ops := NewOps(c, cidrEntry, WithDesired(func(statedb.ReadTxn) iter.Seq[LPMKeyV4] { return keysOf(desired) }))
		batch := batchOf(desired)
		ops.UpdateBatch(ctx, nil, batch)
		for _, e := range batch {
			if e.Result != nil {
				t.Fatalf("UpdateBatch %v: %v", e.Object.Prefix, e.Result)
			}
		}
		dumpEquals(t, c, wantOf(desired))
	})

	t.Run("Update", func(t *testing.T) {
		c := fill(t)
		// Only part of the new config is desired yet: only as much is evicted.
		keep := append(slices.Clone(stale[:3]), desired[0])
		ops := NewOps(c, cidrEntry, WithDesired(func(statedb.ReadTxn) iter.Seq[LPMKeyV4] { return keysOf(keep) }))
		if err := ops.Update(ctx, nil, 1, desired[0]); err != nil {
			t.Fatalf("Update: %v", err)
		}
		dumpEquals(t, c, wantOf(keep))
	})

	t.Run("without WithDesired", func(t *testing.T) {
		c := fill(t)
		ops := NewOps(c, cidrEntry)
		batch := batchOf(desired)
		ops.UpdateBatch(ctx, nil, batch)
		for _, e := range batch {
			if !errors.Is(e.Result, unix.ENOSPC) {
				t.Fatalf("UpdateBatch %v: %v, want ENOSPC", e.Object.Prefix, e.Result)
			}
		}
		// Nothing was lost: the map still holds what it held.
		dumpEquals(t, c, wantOf(stale))
		// The next prune makes room.
		if err := ops.Prune(ctx, nil, seqOf(desired)); err != nil {
			t.Fatalf("Prune: %v", err)
		}
		dumpEquals(t, c, wantOf(desired))
	})

	t.Run("more desired than fits", func(t *testing.T) {
		c := fill(t)
		all := append(slices.Clone(desired), rows("198.18.0.0/15")...)
		ops := NewOps(c, cidrEntry, WithDesired(func(statedb.ReadTxn) iter.Seq[LPMKeyV4] { return keysOf(all) }))
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
		dumpEquals(t, c, wantOf(desired))
	})
}

// TestOpsDistinctKeys: with WithDistinctKeys a batch is written and removed
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
	for i, opts := range [][]OpsOption[LPMKeyV4]{nil, {WithDistinctKeys[LPMKeyV4]()}} {
		c := newCache(t, newLPMv4(t, n))
		ops := NewOps(c, cidrEntry, opts...)
		batch := batchOf(objs)
		written[i] = allocated(func() { ops.UpdateBatch(ctx, nil, batch) })
		for _, e := range batch {
			if e.Result != nil {
				t.Fatalf("options %d: UpdateBatch %v: %v", i, e.Object.Prefix, e.Result)
			}
		}
		got, err := c.Dump()
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(got, wantOf(objs)) {
			t.Fatalf("options %d: map holds %d entries, want the %d written", i, len(got), n)
		}
		removed[i] = allocated(func() { ops.DeleteBatch(ctx, nil, batch) })
		for _, e := range batch {
			if e.Result != nil {
				t.Fatalf("options %d: DeleteBatch %v: %v", i, e.Object.Prefix, e.Result)
			}
		}
		if got, err := c.Dump(); err != nil || len(got) != 0 {
			t.Fatalf("options %d: after DeleteBatch the map holds %d entries (%v)", i, len(got), err)
		}
	}
	// The map of repeated keys holds at least a key and an index per entry.
	const mapBytes = n * 12
	if written[1]+mapBytes > written[0] {
		t.Errorf("UpdateBatch allocated %d bytes with WithDistinctKeys, %d without; want at least %d fewer", written[1], written[0], mapBytes)
	}
	if removed[1]+mapBytes > removed[0] {
		t.Errorf("DeleteBatch allocated %d bytes with WithDistinctKeys, %d without; want at least %d fewer", removed[1], removed[0], mapBytes)
	}
}
