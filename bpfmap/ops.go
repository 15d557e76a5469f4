package bpfmap

import (
	"context"
	"errors"
	"fmt"
	"iter"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"
)

// Ops implements reconciler.Operations[Obj] and reconciler.BatchOperations[Obj]
// for a table whose rows map one-to-one to map entries.
type Ops[Obj any, K comparable, V comparable] struct {
	m        *Map[K, V]
	entry    func(Obj) (K, V)
	desired  func(statedb.ReadTxn) iter.Seq[K]
	distinct bool
}

var (
	_ reconciler.Operations[int]      = (*Ops[int, uint32, uint32])(nil)
	_ reconciler.BatchOperations[int] = (*Ops[int, uint32, uint32])(nil)
)

// OpsOption configures NewOps.
type OpsOption[K comparable] func(*opsOptions[K])

type opsOptions[K comparable] struct {
	desired  func(statedb.ReadTxn) iter.Seq[K]
	distinct bool
}

// WithDesired tells Ops how to list the keys the table wants in the map,
// without waiting for a Prune. When the map is full (ENOSPC) during Update or
// UpdateBatch, Ops then re-reads the map, deletes the entries that are not
// desired (stale entries left by a previous configuration, before the first
// prune) and retries the failed entries once. Without it a full map is an
// error until the next Prune.
func WithDesired[K comparable](desired func(txn statedb.ReadTxn) iter.Seq[K]) OpsOption[K] {
	return func(o *opsOptions[K]) { o.desired = desired }
}

// WithDistinctKeys promises that entry gives different rows different keys,
// as when the key is made from the row's primary key alone. A batch of the
// reconciler holds each row once, so no key repeats in it, and UpdateBatch
// and DeleteBatch skip Put's and Delete's search for repeated keys: a map
// as large as the batch, built on every batch (about half of what Put and
// Delete allocated for a 16 384-prefix config).
// If the promise is broken, which value the kernel keeps for a repeated
// key is undefined.
func WithDistinctKeys[K comparable]() OpsOption[K] {
	return func(o *opsOptions[K]) { o.distinct = true }
}

// NewOps returns operations that write the entry entry(obj) of each row to m.
func NewOps[Obj any, K comparable, V comparable](m *Map[K, V], entry func(Obj) (K, V), opts ...OpsOption[K]) *Ops[Obj, K, V] {
	var o opsOptions[K]
	for _, opt := range opts {
		opt(&o)
	}
	return &Ops[Obj, K, V]{m: m, entry: entry, desired: o.desired, distinct: o.distinct}
}

// Update writes the row's entry; it costs nothing when the map already holds it.
func (o *Ops[Obj, K, V]) Update(ctx context.Context, txn statedb.ReadTxn, _ statedb.Revision, obj Obj) error {
	k, v := o.entry(obj)
	return o.put(txn, []KV[K, V]{{Key: k, Value: v}})[0]
}

// Delete removes the row's entry; an entry already absent is not an error.
func (o *Ops[Obj, K, V]) Delete(ctx context.Context, txn statedb.ReadTxn, _ statedb.Revision, obj Obj) error {
	k, _ := o.entry(obj)
	return o.m.Delete([]K{k})[0]
}

// UpdateBatch writes the entries of all rows, in one syscall where possible,
// and sets each BatchEntry's Result.
func (o *Ops[Obj, K, V]) UpdateBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	kvs := make([]KV[K, V], len(batch))
	for i := range batch {
		kvs[i].Key, kvs[i].Value = o.entry(batch[i].Object)
	}
	for i, err := range o.put(txn, kvs) {
		batch[i].Result = err
	}
}

// DeleteBatch removes the entries of all rows and sets each BatchEntry's Result.
func (o *Ops[Obj, K, V]) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	keys := make([]K, len(batch))
	for i := range batch {
		keys[i], _ = o.entry(batch[i].Object)
	}
	for i, err := range o.m.delete(keys, o.distinct) {
		batch[i].Result = err
	}
}

// Prune makes the map equal to objects: it re-reads the map from the kernel,
// deletes the entries no object wants, then writes every wanted entry the
// map lacks or holds with another value. Deleting first makes room, so a
// full map of stale entries does not refuse the new ones. When the kernel
// already matches, it writes nothing.
func (o *Ops[Obj, K, V]) Prune(ctx context.Context, txn statedb.ReadTxn, objects iter.Seq2[Obj, statedb.Revision]) error {
	var kvs []KV[K, V]
	for obj := range objects {
		k, v := o.entry(obj)
		kvs = append(kvs, KV[K, V]{Key: k, Value: v})
	}
	if err := o.m.Sync(kvs); err != nil {
		return fmt.Errorf("prune: %w", err)
	}
	return nil
}

// put writes kvs and, when the map is full and the desired keys are known,
// evicts undesired entries and retries the entries that did not fit.
func (o *Ops[Obj, K, V]) put(txn statedb.ReadTxn, kvs []KV[K, V]) []error {
	errs := o.m.put(kvs, o.distinct)
	if o.desired == nil {
		return errs
	}
	var retry []int
	for i, err := range errs {
		if errors.Is(err, unix.ENOSPC) {
			retry = append(retry, i)
		}
	}
	if len(retry) == 0 {
		return errs
	}
	if err := o.evict(txn, kvs); err != nil {
		for _, i := range retry {
			errs[i] = errors.Join(errs[i], fmt.Errorf("make room: %w", err))
		}
		return errs
	}
	again := make([]KV[K, V], len(retry))
	for j, i := range retry {
		again[j] = kvs[i]
	}
	for j, err := range o.m.put(again, o.distinct) {
		errs[retry[j]] = err
	}
	return errs
}

// evict deletes the map's entries that are neither desired nor being written.
// It only deletes, so no wanted entry is lost on the way.
func (o *Ops[Obj, K, V]) evict(txn statedb.ReadTxn, pending []KV[K, V]) error {
	// The cache may miss entries others added: the kernel's view decides
	// what occupies the map.
	if err := o.m.Resync(); err != nil {
		return err
	}
	want := make(map[K]struct{}, len(pending))
	for k := range o.desired(txn) {
		want[k] = struct{}{}
	}
	for _, kv := range pending {
		want[kv.Key] = struct{}{}
	}
	return errors.Join(o.m.Delete(o.m.keysNotIn(want))...)
}
