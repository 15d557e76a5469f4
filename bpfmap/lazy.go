package bpfmap

import (
	"context"
	"iter"
	"sync"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
)

// Lazy are Operations built at first use, for a reconciler whose maps are
// opened by a start hook: the Operations go into the hive at construction
// (so that tests decorate them, e.g. faults.Decorate), while the maps exist
// only once the hive has started. Until build succeeds every operation fails
// with build's error, and the reconciler retries it.
//
// Lazy implements reconciler.BatchOperations too: a batch goes to the built
// operations' UpdateBatch/DeleteBatch when they have them, entry by entry
// otherwise.
type Lazy[Obj any] struct {
	build func() (reconciler.Operations[Obj], error)

	mu  sync.Mutex
	ops reconciler.Operations[Obj]
}

var (
	_ reconciler.Operations[int]      = (*Lazy[int])(nil)
	_ reconciler.BatchOperations[int] = (*Lazy[int])(nil)
)

// NewLazy returns Operations that call build at their first use, and again
// at each use until it succeeds.
func NewLazy[Obj any](build func() (reconciler.Operations[Obj], error)) *Lazy[Obj] {
	return &Lazy[Obj]{build: build}
}

func (l *Lazy[Obj]) get() (reconciler.Operations[Obj], error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ops != nil {
		return l.ops, nil
	}
	ops, err := l.build()
	if err != nil {
		return nil, err
	}
	l.ops = ops
	return ops, nil
}

// Update implements reconciler.Operations.
func (l *Lazy[Obj]) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Update(ctx, txn, rev, obj)
}

// Delete implements reconciler.Operations.
func (l *Lazy[Obj]) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Delete(ctx, txn, rev, obj)
}

// Prune implements reconciler.Operations.
func (l *Lazy[Obj]) Prune(ctx context.Context, txn statedb.ReadTxn, objs iter.Seq2[Obj, statedb.Revision]) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Prune(ctx, txn, objs)
}

// UpdateBatch implements reconciler.BatchOperations.
func (l *Lazy[Obj]) UpdateBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	l.batch(ctx, txn, batch, true)
}

// DeleteBatch implements reconciler.BatchOperations.
func (l *Lazy[Obj]) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	l.batch(ctx, txn, batch, false)
}

func (l *Lazy[Obj]) batch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj], update bool) {
	ops, err := l.get()
	if err != nil {
		for i := range batch {
			batch[i].Result = err
		}
		return
	}
	runBatch(ctx, txn, ops, batch, update)
}
