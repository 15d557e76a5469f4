package bpfmap

import (
	"context"
	"errors"
	"fmt"
	"iter"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
)

// ByFamily sends each row of a table that holds both address families to
// the Operations of its family: the kernel has one map per family, readers
// want one table. A nil V4 or V6 means the family is disabled: updating a
// row of a disabled family is an error naming the row, deleting one is a
// no-op (no map can hold it).
//
// ByFamily implements reconciler.BatchOperations too; a batch is split by
// family and each half goes to its side's UpdateBatch/DeleteBatch when the
// side has them, row by row otherwise.
type ByFamily[Obj any] struct {
	V4, V6 reconciler.Operations[Obj]
	// Is4 reports whether obj belongs to the IPv4 side.
	Is4 func(obj Obj) bool
	// Name names obj in errors, e.g. its prefix.
	Name func(obj Obj) string
	// MapV4 and MapV6, when set, name the maps in Prune's errors.
	MapV4, MapV6 string
}

var (
	_ reconciler.Operations[int]      = (*ByFamily[int])(nil)
	_ reconciler.BatchOperations[int] = (*ByFamily[int])(nil)
)

func (b *ByFamily[Obj]) side(obj Obj) (reconciler.Operations[Obj], error) {
	ops, fam := b.V6, "IPv6"
	if b.Is4(obj) {
		ops, fam = b.V4, "IPv4"
	}
	if ops == nil {
		return nil, fmt.Errorf("%s: %s is disabled, there is no map for it", b.Name(obj), fam)
	}
	return ops, nil
}

// Update implements reconciler.Operations.
func (b *ByFamily[Obj]) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	ops, err := b.side(obj)
	if err != nil {
		return err
	}
	return ops.Update(ctx, txn, rev, obj)
}

// Delete implements reconciler.Operations.
func (b *ByFamily[Obj]) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	ops, err := b.side(obj)
	if err != nil {
		return nil
	}
	return ops.Delete(ctx, txn, rev, obj)
}

// Prune implements reconciler.Operations: each enabled side prunes against
// its family's rows.
func (b *ByFamily[Obj]) Prune(ctx context.Context, txn statedb.ReadTxn, objs iter.Seq2[Obj, statedb.Revision]) error {
	only := func(v4 bool) iter.Seq2[Obj, statedb.Revision] {
		return func(yield func(Obj, statedb.Revision) bool) {
			for obj, rev := range objs {
				if b.Is4(obj) == v4 && !yield(obj, rev) {
					return
				}
			}
		}
	}
	var errs []error
	prune := func(ops reconciler.Operations[Obj], v4 bool, name string) {
		if ops == nil {
			return
		}
		if err := ops.Prune(ctx, txn, only(v4)); err != nil && name != "" {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		} else if err != nil {
			errs = append(errs, err)
		}
	}
	prune(b.V4, true, b.MapV4)
	prune(b.V6, false, b.MapV6)
	return errors.Join(errs...)
}

// UpdateBatch implements reconciler.BatchOperations.
func (b *ByFamily[Obj]) UpdateBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	b.batch(ctx, txn, batch, true)
}

// DeleteBatch implements reconciler.BatchOperations.
func (b *ByFamily[Obj]) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	b.batch(ctx, txn, batch, false)
}

func (b *ByFamily[Obj]) batch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj], update bool) {
	// Sized up front: a 16 384-prefix config is one batch per family, and
	// growing these by appending was the largest allocation of a load.
	n4 := 0
	for i := range batch {
		if b.Is4(batch[i].Object) {
			n4++
		}
	}
	// A batch of one family (the usual case: an IPv4-only config, or one
	// change) goes to its side as it is, without copying its entries.
	if one := b.V4; (n4 == len(batch) && one != nil) || (n4 == 0 && b.V6 != nil) {
		if n4 == 0 {
			one = b.V6
		}
		runBatch(ctx, txn, one, batch, update)
		return
	}
	v4, v6 := make([]reconciler.BatchEntry[Obj], 0, n4), make([]reconciler.BatchEntry[Obj], 0, len(batch)-n4)
	i4, i6 := make([]int, 0, n4), make([]int, 0, len(batch)-n4)
	for i := range batch {
		if _, err := b.side(batch[i].Object); err != nil {
			if update {
				batch[i].Result = err
			} else {
				batch[i].Result = nil
			}
		} else if b.Is4(batch[i].Object) {
			v4, i4 = append(v4, batch[i]), append(i4, i)
		} else {
			v6, i6 = append(v6, batch[i]), append(i6, i)
		}
	}
	run := func(ops reconciler.Operations[Obj], part []reconciler.BatchEntry[Obj], idx []int) {
		if len(part) == 0 {
			return
		}
		runBatch(ctx, txn, ops, part, update)
		for j, i := range idx {
			batch[i].Result = part[j].Result
		}
	}
	run(b.V4, v4, i4)
	run(b.V6, v6, i6)
}

// runBatch hands batch to ops as one batch where ops has batch operations,
// entry by entry otherwise.
func runBatch[Obj any](ctx context.Context, txn statedb.ReadTxn, ops reconciler.Operations[Obj], batch []reconciler.BatchEntry[Obj], update bool) {
	if bops, ok := ops.(reconciler.BatchOperations[Obj]); ok {
		if update {
			bops.UpdateBatch(ctx, txn, batch)
		} else {
			bops.DeleteBatch(ctx, txn, batch)
		}
		return
	}
	for i := range batch {
		if update {
			batch[i].Result = ops.Update(ctx, txn, batch[i].Revision, batch[i].Object)
		} else {
			batch[i].Result = ops.Delete(ctx, txn, batch[i].Revision, batch[i].Object)
		}
	}
}
