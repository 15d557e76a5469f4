package faults

import (
	"context"
	"iter"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
)

// Wrap returns ops failing with the injected error at the point while it
// fails, and calling through otherwise. With a nil Injector it returns ops
// itself: production pays nothing.
func Wrap[Obj any](inj *Injector, point string, ops reconciler.Operations[Obj]) reconciler.Operations[Obj] {
	if inj == nil || ops == nil {
		return ops
	}
	return &faultyOps[Obj]{inj: inj, point: point, ops: ops}
}

// WrapBatch is Wrap for batch operations: while the point fails, every
// entry of a batch gets the injected error as its Result.
func WrapBatch[Obj any](inj *Injector, point string, ops reconciler.BatchOperations[Obj]) reconciler.BatchOperations[Obj] {
	if inj == nil || ops == nil {
		return ops
	}
	return &faultyBatchOps[Obj]{inj: inj, point: point, ops: ops}
}

type faultyOps[Obj any] struct {
	inj   *Injector
	point string
	ops   reconciler.Operations[Obj]
}

// Update implements reconciler.Operations.
func (f *faultyOps[Obj]) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	if err := f.inj.inject(f.point, 1); err != nil {
		return err
	}
	return f.ops.Update(ctx, txn, rev, obj)
}

// Delete implements reconciler.Operations.
func (f *faultyOps[Obj]) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	if err := f.inj.inject(f.point, 1); err != nil {
		return err
	}
	return f.ops.Delete(ctx, txn, rev, obj)
}

// Prune implements reconciler.Operations.
func (f *faultyOps[Obj]) Prune(ctx context.Context, txn statedb.ReadTxn, objs iter.Seq2[Obj, statedb.Revision]) error {
	if err := f.inj.inject(f.point, 1); err != nil {
		return err
	}
	return f.ops.Prune(ctx, txn, objs)
}

type faultyBatchOps[Obj any] struct {
	inj   *Injector
	point string
	ops   reconciler.BatchOperations[Obj]
}

// UpdateBatch implements reconciler.BatchOperations.
func (f *faultyBatchOps[Obj]) UpdateBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	if f.fail(batch) {
		return
	}
	f.ops.UpdateBatch(ctx, txn, batch)
}

// DeleteBatch implements reconciler.BatchOperations.
func (f *faultyBatchOps[Obj]) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	if f.fail(batch) {
		return
	}
	f.ops.DeleteBatch(ctx, txn, batch)
}

// fail sets the injected error on every entry when the point fails.
func (f *faultyBatchOps[Obj]) fail(batch []reconciler.BatchEntry[Obj]) bool {
	if len(batch) == 0 {
		return false
	}
	err := f.inj.inject(f.point, len(batch))
	if err == nil {
		return false
	}
	for i := range batch {
		batch[i].Result = err
	}
	return true
}
