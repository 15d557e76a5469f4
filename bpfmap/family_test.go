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
