package bpfmap

import (
	"context"
	"errors"
	"iter"
	"slices"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
)

// recordOps records what reaches one side of a ByFamily.
type recordOps struct {
	updated, deleted, pruned []int
	fail                     error
}

func (r *recordOps) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, n int) error {
	r.updated = append(r.updated, n)
	return r.fail
}

func (r *recordOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, n int) error {
	r.deleted = append(r.deleted, n)
	return nil
}

func (r *recordOps) Prune(_ context.Context, _ statedb.ReadTxn, objs iter.Seq2[int, statedb.Revision]) error {
	for n := range objs {
		r.pruned = append(r.pruned, n)
	}
	return r.fail
}

// Even numbers are "IPv4", odd ones "IPv6".
func newByFamily(v4, v6 reconciler.Operations[int]) *ByFamily[int] {
	return &ByFamily[int]{V4: v4, V6: v6, Is4: func(n int) bool { return n%2 == 0 },
		Name: func(int) string { return "row" }, MapV4: "m4", MapV6: "m6"}
}

func TestByFamilyDispatch(t *testing.T) {
	v4, v6 := &recordOps{}, &recordOps{}
	b := newByFamily(v4, v6)
	ctx := context.Background()
	for _, n := range []int{1, 2, 3, 4} {
		if err := b.Update(ctx, nil, 0, n); err != nil {
			t.Fatal(err)
		}
	}
	b.Delete(ctx, nil, 0, 5)
	all := func(yield func(int, statedb.Revision) bool) {
		for _, n := range []int{6, 7, 8} {
			if !yield(n, 0) {
				return
			}
		}
	}
	if err := b.Prune(ctx, nil, all); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(v4.updated, []int{2, 4}) || !slices.Equal(v6.updated, []int{1, 3}) ||
		!slices.Equal(v6.deleted, []int{5}) || len(v4.deleted) != 0 ||
		!slices.Equal(v4.pruned, []int{6, 8}) || !slices.Equal(v6.pruned, []int{7}) {
		t.Fatalf("v4 %+v v6 %+v", v4, v6)
	}
}

func TestByFamilyDisabledAndErrors(t *testing.T) {
	v4 := &recordOps{fail: errors.New("no space left on device")}
	b := newByFamily(v4, nil)
	ctx := context.Background()
	if err := b.Update(ctx, nil, 0, 1); err == nil || err.Error() != "row: IPv6 is disabled, there is no map for it" {
		t.Fatalf("update of a disabled family: %v", err)
	}
	if err := b.Delete(ctx, nil, 0, 1); err != nil {
		t.Fatalf("delete of a disabled family: %v, want nil", err)
	}
	err := b.Prune(ctx, nil, func(func(int, statedb.Revision) bool) {})
	if err == nil || err.Error() != "m4: no space left on device" {
		t.Fatalf("prune error %v, want the map's name", err)
	}
	batch := []reconciler.BatchEntry[int]{{Object: 2}, {Object: 3}}
	b.UpdateBatch(ctx, nil, batch)
	if batch[0].Result == nil || batch[0].Result.Error() != "no space left on device" || batch[1].Result == nil {
		t.Fatalf("batch results %v %v", batch[0].Result, batch[1].Result)
	}
	b.DeleteBatch(ctx, nil, batch)
	if batch[0].Result != nil || batch[1].Result != nil {
		t.Fatalf("delete batch results %v %v, want nil", batch[0].Result, batch[1].Result)
	}
}

// batchOps records the batches that reach one side.
type batchOps struct {
	recordOps
	batches [][]int
}

func (r *batchOps) UpdateBatch(_ context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[int]) {
	var ns []int
	for i := range batch {
		ns = append(ns, batch[i].Object)
		if batch[i].Object > 100 {
			batch[i].Result = errors.New("refused")
		}
	}
	r.batches = append(r.batches, ns)
}

func (r *batchOps) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[int]) {
	r.UpdateBatch(ctx, txn, batch)
}

// TestByFamilyBatches: a batch of one family reaches its side whole and in
// order, with each row's result; a mixed batch is split by family; a batch
// of a disabled family gets an error per row on update, none on delete.
func TestByFamilyBatches(t *testing.T) {
	ctx := context.Background()
	v4, v6 := &batchOps{}, &batchOps{}
	b := newByFamily(v4, v6)
	only4 := []reconciler.BatchEntry[int]{{Object: 2}, {Object: 102}, {Object: 4}}
	b.UpdateBatch(ctx, nil, only4)
	if len(v4.batches) != 1 || !slices.Equal(v4.batches[0], []int{2, 102, 4}) || len(v6.batches) != 0 {
		t.Fatalf("IPv4-only batch: v4 %v v6 %v", v4.batches, v6.batches)
	}
	if only4[0].Result != nil || only4[1].Result == nil || only4[2].Result != nil {
		t.Fatalf("IPv4-only batch results %v", []error{only4[0].Result, only4[1].Result, only4[2].Result})
	}
	only6 := []reconciler.BatchEntry[int]{{Object: 1}, {Object: 3}}
	b.DeleteBatch(ctx, nil, only6)
	if len(v6.batches) != 1 || !slices.Equal(v6.batches[0], []int{1, 3}) || len(v4.batches) != 1 {
		t.Fatalf("IPv6-only batch: v4 %v v6 %v", v4.batches, v6.batches)
	}
	mixed := []reconciler.BatchEntry[int]{{Object: 1}, {Object: 2}, {Object: 103}, {Object: 6}}
	b.UpdateBatch(ctx, nil, mixed)
	if !slices.Equal(v4.batches[1], []int{2, 6}) || !slices.Equal(v6.batches[1], []int{1, 103}) {
		t.Fatalf("mixed batch: v4 %v v6 %v", v4.batches, v6.batches)
	}
	if mixed[0].Result != nil || mixed[1].Result != nil || mixed[2].Result == nil || mixed[3].Result != nil {
		t.Fatalf("mixed batch results %v", []error{mixed[0].Result, mixed[1].Result, mixed[2].Result, mixed[3].Result})
	}

	noV6 := newByFamily(v4, nil)
	disabled := []reconciler.BatchEntry[int]{{Object: 1}, {Object: 3}}
	noV6.UpdateBatch(ctx, nil, disabled)
	if disabled[0].Result == nil || disabled[1].Result == nil || len(v4.batches) != 2 {
		t.Fatalf("update of a disabled family: results %v %v, v4 batches %v", disabled[0].Result, disabled[1].Result, v4.batches)
	}
	noV6.DeleteBatch(ctx, nil, disabled)
	if disabled[0].Result != nil || disabled[1].Result != nil {
		t.Fatalf("delete of a disabled family: %v %v, want nil", disabled[0].Result, disabled[1].Result)
	}
}
