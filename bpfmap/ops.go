package bpfmap

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"
)

// Loader finds a loaded map by its name. The agent's datapath loader
// (reconcilers/datapath) is one: its maps exist only once the hive has
// started, and until then LoadedMap fails, which fails the operation (the
// reconciler retries it).
type Loader interface {
	LoadedMap(name string) (*ebpf.Map, error)
}

// Entries says how the rows of one table become the entries of a pair of
// maps, one per address family: the kernel has a map per family, readers
// want one table. Its functions are pure conversions of a row; Ops calls
// nothing else of its user.
type Entries[Obj any, K4, K6, V comparable] struct {
	// MapV4 and MapV6 name the maps (Loader.LoadedMap); "" means the family
	// is disabled: updating a row of it is an error naming the row,
	// deleting one is a no-op (no map can hold it).
	MapV4, MapV6 string
	// Is4 reports whether a row belongs to the IPv4 map.
	Is4 func(Obj) bool
	// V4 and V6 are the entry of a row of their family.
	V4 func(Obj) (K4, V)
	V6 func(Obj) (K6, V)
	// Name names a row in errors, e.g. its prefix.
	Name func(Obj) string
	// Table, when set, is the table whose rows the maps must hold. When a
	// map is full (ENOSPC) during an update, Ops then re-reads the map,
	// deletes the entries that no row of Table wants (stale entries left
	// by a previous configuration, before the first prune) and retries the
	// entries that failed, once. Without it a full map is an error until
	// the next Prune.
	Table Rows[Obj]
	// DistinctKeys promises that different rows have different keys, as
	// when the key is made from the row's primary key alone. A batch of
	// the reconciler holds each row once, so no key repeats in it, and
	// the batches skip Map's search for repeated keys: a map as large as
	// the batch, built on every batch (about half of what a 16 384-prefix
	// config allocated). If the promise is broken, which value the kernel
	// keeps for a repeated key is undefined.
	DistinctKeys bool
}

// Rows is what Ops reads of a table: a statedb.Table is one.
type Rows[Obj any] interface {
	All(statedb.ReadTxn) iter.Seq2[Obj, statedb.Revision]
}

// Ops implements reconciler.Operations and reconciler.BatchOperations for a
// table whose rows map one-to-one to entries of a map per family: each row
// goes to its family's Map, a batch to each family's map in one write.
//
// The maps are opened at first use (from the Loader), since a reconciler's
// Operations are built before the hive starts and the maps exist only
// once it has; until they open, every operation (every entry of a batch)
// fails with the Loader's error.
type Ops[Obj any, K4, K6, V comparable] struct {
	loader Loader
	e      Entries[Obj, K4, K6, V]

	mu     sync.Mutex
	opened bool
	v4     family[Obj, K4, V]
	v6     family[Obj, K6, V]
}

// family is one family's map, how a row becomes its entry and the parts
// of Entries it needs.
type family[Obj any, K, V comparable] struct {
	m        *Map[K, V] // nil: the family is disabled
	entry    func(Obj) (K, V)
	name     string // the map's name
	fam      string // "IPv4" or "IPv6"
	mine     func(Obj) bool
	rowName  func(Obj) string
	table    Rows[Obj]
	distinct bool
}

var (
	_ reconciler.Operations[int]      = (*Ops[int, uint32, uint64, uint8])(nil)
	_ reconciler.BatchOperations[int] = (*Ops[int, uint32, uint64, uint8])(nil)
)

// NewOps returns the operations that write the rows described by e into
// the maps loader has under e's names.
func NewOps[Obj any, K4, K6, V comparable](loader Loader, e Entries[Obj, K4, K6, V]) *Ops[Obj, K4, K6, V] {
	is6 := func(obj Obj) bool { return !e.Is4(obj) }
	return &Ops[Obj, K4, K6, V]{loader: loader, e: e,
		v4: family[Obj, K4, V]{entry: e.V4, name: e.MapV4, fam: "IPv4", mine: e.Is4, rowName: e.Name, table: e.Table, distinct: e.DistinctKeys},
		v6: family[Obj, K6, V]{entry: e.V6, name: e.MapV6, fam: "IPv6", mine: is6, rowName: e.Name, table: e.Table, distinct: e.DistinctKeys}}
}

// Maps returns the maps the operations write through, each nil while its
// family is disabled or the maps are not open yet.
func (o *Ops[Obj, K4, K6, V]) Maps() (*Map[K4, V], *Map[K6, V]) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.v4.m, o.v6.m
}

// open opens the maps (reading their contents into the cache, so that a
// restart writes only what differs), once.
func (o *Ops[Obj, K4, K6, V]) open() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.opened {
		return nil
	}
	v4, err := openMap[K4, V](o.loader, o.e.MapV4)
	if err != nil {
		return err
	}
	v6, err := openMap[K6, V](o.loader, o.e.MapV6)
	if err != nil {
		return err
	}
	o.v4.m, o.v6.m, o.opened = v4, v6, true
	return nil
}

func openMap[K, V comparable](loader Loader, name string) (*Map[K, V], error) {
	if name == "" {
		return nil, nil
	}
	m, err := loader.LoadedMap(name)
	if err != nil {
		return nil, err
	}
	c, err := NewMap[K, V](m)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	return c, nil
}

// Update writes the row's entry; it costs nothing when the map already holds it.
func (o *Ops[Obj, K4, K6, V]) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	batch := []reconciler.BatchEntry[Obj]{{Object: obj, Revision: rev}}
	o.batch(txn, batch, true)
	return batch[0].Result
}

// Delete removes the row's entry; an entry already absent, or of a
// disabled family, is not an error.
func (o *Ops[Obj, K4, K6, V]) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	batch := []reconciler.BatchEntry[Obj]{{Object: obj, Revision: rev}}
	o.batch(txn, batch, false)
	return batch[0].Result
}

// UpdateBatch writes the entries of all rows, one batch write per map where
// the kernel supports it, and sets each BatchEntry's Result: nil when the
// row's entry is in its map.
func (o *Ops[Obj, K4, K6, V]) UpdateBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	o.batch(txn, batch, true)
}

// DeleteBatch removes the entries of all rows and sets each BatchEntry's
// Result.
func (o *Ops[Obj, K4, K6, V]) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj]) {
	o.batch(txn, batch, false)
}

// batch splits batch by family and writes (update) or deletes each part.
func (o *Ops[Obj, K4, K6, V]) batch(txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj], update bool) {
	if err := o.open(); err != nil {
		for i := range batch {
			batch[i].Result = err
		}
		return
	}
	// Sized up front: a 16 384-prefix config is one batch per family, and
	// growing these by appending was the largest allocation of a load.
	n4 := 0
	for i := range batch {
		if o.e.Is4(batch[i].Object) {
			n4++
		}
	}
	// A batch of one family (the usual case: an IPv4-only config, or one
	// change) is written as it is, without an index of its entries.
	var i4, i6 []int
	if n4 != 0 && n4 != len(batch) {
		i4, i6 = make([]int, 0, n4), make([]int, 0, len(batch)-n4)
		for i := range batch {
			if o.e.Is4(batch[i].Object) {
				i4 = append(i4, i)
			} else {
				i6 = append(i6, i)
			}
		}
	}
	if n4 > 0 {
		o.v4.write(txn, batch, i4, n4, update)
	}
	if n4 < len(batch) {
		o.v6.write(txn, batch, i6, len(batch)-n4, update)
	}
}

// Prune makes each map equal to its family's rows: it re-reads the map
// from the kernel, deletes the entries no row wants, then writes every
// wanted entry the map lacks or holds with another value. Deleting first
// makes room, so a full map of stale entries does not refuse the new ones.
// When the kernel already matches, it writes nothing. An error names the
// map.
func (o *Ops[Obj, K4, K6, V]) Prune(ctx context.Context, txn statedb.ReadTxn, objects iter.Seq2[Obj, statedb.Revision]) error {
	if err := o.open(); err != nil {
		return err
	}
	return errors.Join(o.v4.prune(objects), o.v6.prune(objects))
}

// write writes (update) or deletes the entries of the n rows of batch at
// idx (all of batch when idx is nil), which are all of this family, and
// sets their Result.
func (f *family[Obj, K, V]) write(txn statedb.ReadTxn, batch []reconciler.BatchEntry[Obj], idx []int, n int, update bool) {
	at := func(j int) *reconciler.BatchEntry[Obj] {
		if idx == nil {
			return &batch[j]
		}
		return &batch[idx[j]]
	}
	if f.m == nil {
		for j := range n {
			e := at(j)
			e.Result = nil
			if update {
				e.Result = fmt.Errorf("%s: %s is disabled, there is no map for it", f.rowName(e.Object), f.fam)
			}
		}
		return
	}
	var errs []error
	if update {
		kvs := make([]KV[K, V], n)
		for j := range n {
			kvs[j].Key, kvs[j].Value = f.entry(at(j).Object)
		}
		errs = f.put(txn, kvs)
	} else {
		keys := make([]K, n)
		for j := range n {
			keys[j], _ = f.entry(at(j).Object)
		}
		errs = f.m.delete(keys, f.distinct)
	}
	for j, err := range errs {
		at(j).Result = err
	}
}

// put writes kvs and, when the map is full and the table says which rows
// are wanted, evicts unwanted entries and retries the entries that did not
// fit.
func (f *family[Obj, K, V]) put(txn statedb.ReadTxn, kvs []KV[K, V]) []error {
	errs := f.m.put(kvs, f.distinct)
	if f.table == nil {
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
	if err := f.evict(txn, kvs); err != nil {
		for _, i := range retry {
			errs[i] = errors.Join(errs[i], fmt.Errorf("make room: %w", err))
		}
		return errs
	}
	again := make([]KV[K, V], len(retry))
	for j, i := range retry {
		again[j] = kvs[i]
	}
	for j, err := range f.m.put(again, f.distinct) {
		errs[retry[j]] = err
	}
	return errs
}

// evict deletes the map's entries that are neither wanted by a row of the
// table nor being written. It only deletes, so no wanted entry is lost on
// the way.
func (f *family[Obj, K, V]) evict(txn statedb.ReadTxn, pending []KV[K, V]) error {
	// The cache may miss entries others added: the kernel's view decides
	// what occupies the map.
	if err := f.m.Resync(); err != nil {
		return err
	}
	want := make(map[K]struct{}, len(pending))
	for row := range f.table.All(txn) {
		if f.mine(row) {
			k, _ := f.entry(row)
			want[k] = struct{}{}
		}
	}
	for _, kv := range pending {
		want[kv.Key] = struct{}{}
	}
	return errors.Join(f.m.Delete(f.m.keysNotIn(want))...)
}

// prune makes the map hold exactly the entries of the family's objects.
func (f *family[Obj, K, V]) prune(objects iter.Seq2[Obj, statedb.Revision]) error {
	if f.m == nil {
		return nil
	}
	var kvs []KV[K, V]
	for obj := range objects {
		if f.mine(obj) {
			k, v := f.entry(obj)
			kvs = append(kvs, KV[K, V]{Key: k, Value: v})
		}
	}
	if err := f.m.Sync(kvs); err != nil {
		return fmt.Errorf("%s: prune: %w", f.name, err)
	}
	return nil
}
