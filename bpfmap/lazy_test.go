package bpfmap

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
)

// TestLazyBuildsAtFirstSuccess: until build succeeds every operation (and
// every entry of a batch) fails with its error; then the built operations
// get every call, and build is not called again.
func TestLazyBuildsAtFirstSuccess(t *testing.T) {
	ctx := context.Background()
	notYet := errors.New("maps not open")
	rec := &recordOps{}
	var ops reconciler.Operations[int]
	builds := 0
	l := NewLazy(func() (reconciler.Operations[int], error) {
		builds++
		if ops == nil {
			return nil, notYet
		}
		return ops, nil
	})

	if err := l.Update(ctx, nil, 1, 2); !errors.Is(err, notYet) {
		t.Fatalf("Update before the maps: %v, want %v", err, notYet)
	}
	batch := []reconciler.BatchEntry[int]{{Object: 4}, {Object: 6}}
	l.UpdateBatch(ctx, nil, batch)
	for _, e := range batch {
		if !errors.Is(e.Result, notYet) {
			t.Fatalf("batch entry %d before the maps: %v, want %v", e.Object, e.Result, notYet)
		}
	}

	ops = rec
	if err := l.Update(ctx, nil, 1, 2); err != nil {
		t.Fatal(err)
	}
	batch = []reconciler.BatchEntry[int]{{Object: 4}, {Object: 6}}
	l.UpdateBatch(ctx, nil, batch) // recordOps has no batch: one by one
	l.DeleteBatch(ctx, nil, []reconciler.BatchEntry[int]{{Object: 8}})
	if err := l.Delete(ctx, nil, 1, 10); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(rec.updated, []int{2, 4, 6}) || !slices.Equal(rec.deleted, []int{8, 10}) {
		t.Errorf("built operations got updates %v, deletes %v; want [2 4 6], [8 10]", rec.updated, rec.deleted)
	}
	if builds != 3 {
		t.Errorf("build called %d times, want 3 (two failures, one success)", builds)
	}
}

// batchRecordOps records the batches that reach it.
type batchRecordOps struct {
	recordOps
	batches [][]int
}

func (b *batchRecordOps) UpdateBatch(_ context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[int]) {
	var objs []int
	for _, e := range batch {
		objs = append(objs, e.Object)
	}
	b.batches = append(b.batches, objs)
}

func (b *batchRecordOps) DeleteBatch(context.Context, statedb.ReadTxn, []reconciler.BatchEntry[int]) {
}

// TestLazyBatchGoesToBatchOperations: built operations with batches get the
// batch whole, not entry by entry.
func TestLazyBatchGoesToBatchOperations(t *testing.T) {
	b := &batchRecordOps{}
	l := NewLazy(func() (reconciler.Operations[int], error) { return b, nil })
	l.UpdateBatch(context.Background(), nil, []reconciler.BatchEntry[int]{{Object: 4}, {Object: 5}})
	if len(b.batches) != 1 || !slices.Equal(b.batches[0], []int{4, 5}) || len(b.updated) != 0 {
		t.Errorf("batches %v, single updates %v; want one batch [4 5] and none", b.batches, b.updated)
	}
}
