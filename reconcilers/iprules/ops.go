package iprules

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// Ops implements reconciler.Operations[*tables.IPRule]. It caches the owned
// rules so that Update and Delete write only when the kernel differs; the
// cache is loaded from the Target by the first operation and reloaded by
// every Prune, which repairs whatever changed behind the agent's back.
type Ops struct {
	target Target

	mu sync.Mutex
	// owned holds the rules with Protocol that the Target has, in their
	// compact form; nil until the first successful List.
	owned map[cacheKey]struct{}

	rules         atomic.Int64
	adds, deletes atomic.Uint64
}

// Stats counts what Ops did to its Target.
type Stats struct {
	// Rules is the number of owned rules in the Target, as far as Ops knows.
	Rules int
	// Adds and Deletes are the writes made since NewOps; "already there"
	// and "already gone" cost none.
	Adds, Deletes uint64
}

var (
	_ reconciler.Operations[*tables.IPRule]      = (*Ops)(nil)
	_ reconciler.BatchOperations[*tables.IPRule] = (*Ops)(nil)
)

// NewOps returns operations that write the ip-rules table's rows to t.
func NewOps(t Target) *Ops {
	return &Ops{target: t}
}

// Stats returns the counters; it is safe for concurrent use.
func (o *Ops) Stats() Stats {
	return Stats{
		Rules:   int(o.rules.Load()),
		Adds:    o.adds.Load(),
		Deletes: o.deletes.Load(),
	}
}

// Update installs the row's rule unless the target already has it.
func (o *Ops) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, r *tables.IPRule) error {
	k := Canonical(r.Key())
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.load(); err != nil {
		return err
	}
	if _, ok := o.owned[toCacheKey(k)]; ok {
		return nil
	}
	return o.add(k)
}

// Delete removes the row's rule unless the target already lacks it.
func (o *Ops) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, r *tables.IPRule) error {
	k := Canonical(r.Key())
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.load(); err != nil {
		return err
	}
	if _, ok := o.owned[toCacheKey(k)]; !ok {
		return nil
	}
	return o.del(k)
}

// UpdateBatch installs the rules of batch that the target lacks, in one
// exchange when the target is a BatchTarget. Each entry's Result is its own
// rule's outcome: a rule the kernel refuses fails alone and is retried.
func (o *Ops) UpdateBatch(ctx context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.IPRule]) {
	o.batch(ctx, batch, true)
}

// DeleteBatch removes the rules of batch that the target has, like
// UpdateBatch.
func (o *Ops) DeleteBatch(ctx context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.IPRule]) {
	o.batch(ctx, batch, false)
}

func (o *Ops) batch(ctx context.Context, batch []reconciler.BatchEntry[*tables.IPRule], add bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.load(); err != nil {
		for i := range batch {
			batch[i].Result = err
		}
		return
	}
	// Only the rules that differ are written; a key twice in the batch
	// (rows whose keys are equal once canonical) is written once.
	var keys []tables.IPRuleKey
	var entries [][]int
	at := make(map[tables.IPRuleKey]int)
	for i := range batch {
		batch[i].Result = nil
		k := Canonical(batch[i].Object.Key())
		if _, has := o.owned[toCacheKey(k)]; has == add {
			continue
		}
		if j, ok := at[k]; ok {
			entries[j] = append(entries[j], i)
			continue
		}
		at[k] = len(keys)
		keys = append(keys, k)
		entries = append(entries, []int{i})
	}
	for j, err := range o.write(ctx, keys, add) {
		for _, i := range entries[j] {
			batch[i].Result = err
		}
	}
}

// write adds or deletes keys, in one exchange when the target batches, and
// returns each key's error. The cache and counters follow what succeeded.
// Once ctx is done, the keys not yet written fail with its error.
func (o *Ops) write(ctx context.Context, keys []tables.IPRuleKey, add bool) []error {
	errs := make([]error, len(keys))
	if bt, ok := o.target.(BatchTarget); ok && len(keys) > 0 {
		if err := ctx.Err(); err != nil {
			for i := range errs {
				errs[i] = err
			}
			return errs
		}
		if add {
			errs = bt.AddBatch(keys)
		} else {
			errs = bt.DelBatch(keys)
		}
		for i, k := range keys {
			if errs[i] == nil {
				o.written(k, add)
			}
		}
		return errs
	}
	for i, k := range keys {
		if errs[i] = ctx.Err(); errs[i] != nil {
			continue
		}
		if add {
			errs[i] = o.target.Add(k)
		} else {
			errs[i] = o.target.Del(k)
		}
		if errs[i] == nil {
			o.written(k, add)
		}
	}
	return errs
}

// written records a successful write of k in the cache and counters.
func (o *Ops) written(k tables.IPRuleKey, add bool) {
	if add {
		o.adds.Add(1)
		o.owned[toCacheKey(k)] = struct{}{}
	} else {
		o.deletes.Add(1)
		delete(o.owned, toCacheKey(k))
	}
	o.rules.Store(int64(len(o.owned)))
}

// Prune makes the owned rules equal to objects. It re-lists the target
// first, so rules deleted or added behind the agent's back are repaired,
// then adds the missing rules before deleting the stale ones: a rule that
// moves to another table is never absent in between. Rules of other
// protocols are never listed, so never deleted. When the target already
// matches, it writes nothing. It keeps going after a failed write and
// returns all errors.
func (o *Ops) Prune(ctx context.Context, _ statedb.ReadTxn, objects iter.Seq2[*tables.IPRule, statedb.Revision]) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.reload(); err != nil {
		return fmt.Errorf("prune: %w", err)
	}
	want := make(map[cacheKey]struct{})
	var missing []tables.IPRuleKey
	for r := range objects {
		k := Canonical(r.Key())
		ck := toCacheKey(k)
		if _, dup := want[ck]; dup {
			continue
		}
		want[ck] = struct{}{}
		if _, ok := o.owned[ck]; !ok {
			missing = append(missing, k)
		}
	}
	var stale []tables.IPRuleKey
	for ck := range o.owned {
		if _, ok := want[ck]; !ok {
			stale = append(stale, ck.ruleKey())
		}
	}
	// Sorted, so that a prune writes and fails in a reproducible order.
	slices.SortFunc(missing, CompareKeys)
	slices.SortFunc(stale, CompareKeys)

	errs := slices.Concat(o.write(ctx, missing, true), o.write(ctx, stale, false))
	// A cancelled prune reports the cancellation once, not once per rule.
	if err := ctx.Err(); err != nil {
		errs = slices.DeleteFunc(errs, func(e error) bool { return errors.Is(e, err) })
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("prune: %w", err)
	}
	return nil
}

// load fills the cache on first use; a failed List is retried by the next
// operation.
func (o *Ops) load() error {
	if o.owned != nil {
		return nil
	}
	return o.reload()
}

// reload replaces the cache with the target's owned rules.
func (o *Ops) reload() error {
	keys, err := o.target.List()
	if err != nil {
		return err
	}
	owned := make(map[cacheKey]struct{}, len(keys))
	for _, k := range keys {
		owned[toCacheKey(Canonical(k))] = struct{}{}
	}
	o.owned = owned
	o.rules.Store(int64(len(owned)))
	return nil
}

func (o *Ops) add(k tables.IPRuleKey) error {
	if err := o.target.Add(k); err != nil {
		return err
	}
	o.written(k, true)
	return nil
}

func (o *Ops) del(k tables.IPRuleKey) error {
	if err := o.target.Del(k); err != nil {
		return err
	}
	o.written(k, false)
	return nil
}
