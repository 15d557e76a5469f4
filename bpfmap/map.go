package bpfmap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// KV is one map entry.
type KV[K, V any] struct {
	Key   K
	Value V
}

// Stats are a Map's counters.
type Stats struct {
	// Entries is the number of entries the cache holds, i.e. what the map
	// held after the last operation.
	Entries int
	// Writes counts entries created or changed in the kernel since NewMap.
	Writes uint64
	// Deletes counts entries removed from the kernel since NewMap.
	Deletes uint64
	// Syscalls counts bpf() map calls made since NewMap; a batch call counts
	// as one.
	Syscalls uint64
}

// Map is a typed view of a BPF map with an in-memory copy of its contents, so
// that writing a value the map already holds costs no syscall. K and V must be
// fixed-size types (structs of fixed-size fields, arrays, integers) as
// accepted by cilium/ebpf.
//
// The copy is only right while Map is the map's only writer from user space:
// call Resync to repair drift caused by anyone else.
type Map[K comparable, V comparable] struct {
	m *ebpf.Map

	// mu orders writes to the kernel with updates of cache, so that cache
	// always holds what the kernel was last told.
	mu    sync.Mutex
	cache map[K]V

	// Set once the kernel says a batch command is not supported for this
	// map, so that later calls do not pay for a failing syscall.
	noBatchLookup, noBatchUpdate, noBatchDelete atomic.Bool

	entries                   atomic.Int64
	writes, deletes, syscalls atomic.Uint64
}

// NewMap reads the map's current contents (batch lookup where the kernel
// supports it for this map type, iteration otherwise) into the cache.
//
// The sizes of K and V must match the map's key and value size. Per-CPU maps
// are not supported: their values differ per CPU, which a single V cannot
// describe.
func NewMap[K comparable, V comparable](m *ebpf.Map) (*Map[K, V], error) {
	switch m.Type() {
	case ebpf.PerCPUHash, ebpf.PerCPUArray, ebpf.LRUCPUHash, ebpf.PerCPUCGroupStorage:
		return nil, fmt.Errorf("map %s: per-CPU map type %s is not supported", m, m.Type())
	}
	var (
		k K
		v V
	)
	if size := binary.Size(k); size < 0 || uint32(size) != m.KeySize() {
		return nil, fmt.Errorf("map %s: key type %T is %d bytes, map key size is %d", m, k, size, m.KeySize())
	}
	if size := binary.Size(v); size < 0 || uint32(size) != m.ValueSize() {
		return nil, fmt.Errorf("map %s: value type %T is %d bytes, map value size is %d", m, v, size, m.ValueSize())
	}

	bm := &Map[K, V]{m: m}
	if err := bm.Resync(); err != nil {
		return nil, err
	}
	return bm, nil
}

// Put writes entries to the map. Only entries whose cached value differs or
// is absent are written; the others cost nothing. When more than one entry is
// to be written and the kernel supports it, they go in one BatchUpdate; if
// the batch fails part way, the remaining entries are written one Update each,
// so that each error belongs to its entry.
//
// The returned slice is parallel to entries: errs[i] is nil when entries[i]
// is in the map. When a key appears more than once, the last value wins and
// all its occurrences share its result.
func (m *Map[K, V]) Put(entries []KV[K, V]) (errs []error) {
	return m.put(entries, false)
}

// put is Put; distinct says that no key repeats in entries, so that the
// search for repeated keys can be skipped.
func (m *Map[K, V]) put(entries []KV[K, V], distinct bool) (errs []error) {
	errs = make([]error, len(entries))

	m.mu.Lock()
	defer m.mu.Unlock()

	var last map[K]int
	if !distinct {
		last = lastIndex(entries, func(kv KV[K, V]) K { return kv.Key })
	}
	todo := make([]int, 0, len(entries))
	for i, kv := range entries {
		if last != nil && last[kv.Key] != i {
			continue
		}
		if cur, ok := m.cache[kv.Key]; ok && cur == kv.Value {
			continue
		}
		todo = append(todo, i)
	}

	done := 0
	if len(todo) > 1 && !m.noBatchUpdate.Load() {
		keys := make([]K, len(todo))
		values := make([]V, len(todo))
		for j, i := range todo {
			keys[j], values[j] = entries[i].Key, entries[i].Value
		}
		n, err := m.m.BatchUpdate(keys, values, nil)
		m.syscalls.Add(1)
		// On error the kernel reports how many entries it wrote, in order.
		done = min(max(n, 0), len(todo))
		if err == nil {
			done = len(todo)
		} else if errors.Is(err, ebpf.ErrNotSupported) {
			m.noBatchUpdate.Store(true)
		}
		for _, i := range todo[:done] {
			m.cache[entries[i].Key] = entries[i].Value
		}
		m.writes.Add(uint64(done))
	}
	for _, i := range todo[done:] {
		kv := &entries[i]
		err := m.m.Update(&kv.Key, &kv.Value, ebpf.UpdateAny)
		m.syscalls.Add(1)
		if err != nil {
			errs[i] = fmt.Errorf("map %s key %v: %w", m.m, kv.Key, err)
			continue
		}
		m.cache[kv.Key] = kv.Value
		m.writes.Add(1)
	}
	m.entries.Store(int64(len(m.cache)))

	shareResults(entries, last, errs, func(kv KV[K, V]) K { return kv.Key })
	return errs
}

// Delete removes keys from the map. Only keys present in the cache are
// deleted (one BatchDelete where the kernel supports it); a key the kernel no
// longer has (ErrKeyNotExist) counts as deleted. The returned slice is
// parallel to keys.
func (m *Map[K, V]) Delete(keys []K) (errs []error) {
	return m.delete(keys, false)
}

// delete is Delete; distinct says that no key repeats in keys.
func (m *Map[K, V]) delete(keys []K, distinct bool) (errs []error) {
	errs = make([]error, len(keys))

	m.mu.Lock()
	defer m.mu.Unlock()

	var last map[K]int
	if !distinct {
		last = lastIndex(keys, func(k K) K { return k })
	}
	todo := make([]int, 0, len(keys))
	for i, k := range keys {
		if last != nil && last[k] != i {
			continue
		}
		if _, ok := m.cache[k]; ok {
			todo = append(todo, i)
		}
	}

	done := 0
	if len(todo) > 1 && !m.noBatchDelete.Load() {
		batch := make([]K, len(todo))
		for j, i := range todo {
			batch[j] = keys[i]
		}
		n, err := m.m.BatchDelete(batch, nil)
		m.syscalls.Add(1)
		done = min(max(n, 0), len(todo))
		if err == nil {
			done = len(todo)
		} else if errors.Is(err, ebpf.ErrNotSupported) {
			m.noBatchDelete.Store(true)
		}
		for _, i := range todo[:done] {
			delete(m.cache, keys[i])
		}
		m.deletes.Add(uint64(done))
	}
	for _, i := range todo[done:] {
		err := m.m.Delete(&keys[i])
		m.syscalls.Add(1)
		switch {
		case err == nil:
			m.deletes.Add(1)
		case errors.Is(err, ebpf.ErrKeyNotExist):
			// Already gone: the goal is reached.
		default:
			errs[i] = fmt.Errorf("map %s key %v: %w", m.m, keys[i], err)
			continue
		}
		delete(m.cache, keys[i])
	}
	m.entries.Store(int64(len(m.cache)))

	shareResults(keys, last, errs, func(k K) K { return k })
	return errs
}

// Resync re-reads the kernel map into the cache, so that entries changed or
// removed behind Map's back (drift) are seen by the next Put and Delete.
func (m *Map[K, V]) Resync() error {
	m.mu.Lock()
	defer m.mu.Unlock()

	contents, err := m.read()
	if err != nil {
		return err
	}
	m.cache = contents
	m.entries.Store(int64(len(contents)))
	return nil
}

// Sync makes the kernel map hold exactly want: it re-reads the map (drift
// repair), deletes the entries not wanted and writes the wanted ones that
// are missing or differ. When the map is already right it writes nothing.
func (m *Map[K, V]) Sync(want []KV[K, V]) error {
	if err := m.Resync(); err != nil {
		return err
	}
	keys := make(map[K]struct{}, len(want))
	for _, kv := range want {
		keys[kv.Key] = struct{}{}
	}
	errs := m.Delete(m.keysNotIn(keys))
	errs = append(errs, m.Put(want)...)
	return errors.Join(errs...)
}

// Contents returns a copy of the cache: the map as last read or written.
func (m *Map[K, V]) Contents() map[K]V {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.cache)
}

// Dump reads the kernel map now, not the cache.
func (m *Map[K, V]) Dump() (map[K]V, error) {
	return m.read()
}

// Free is how many more entries the map takes: its capacity less the
// entries it held after the last operation.
func (m *Map[K, V]) Free() int {
	return int(m.m.MaxEntries()) - int(m.entries.Load())
}

// Stats returns the counters. It is safe for concurrent use.
func (m *Map[K, V]) Stats() Stats {
	return Stats{
		Entries:  int(m.entries.Load()),
		Writes:   m.writes.Load(),
		Deletes:  m.deletes.Load(),
		Syscalls: m.syscalls.Load(),
	}
}

// keysNotIn returns the cached keys that are not in want.
func (m *Map[K, V]) keysNotIn(want map[K]struct{}) []K {
	m.mu.Lock()
	defer m.mu.Unlock()

	var stale []K
	for k := range m.cache {
		if _, ok := want[k]; !ok {
			stale = append(stale, k)
		}
	}
	return stale
}

// read returns the kernel map's contents.
func (m *Map[K, V]) read() (map[K]V, error) {
	if !m.noBatchLookup.Load() {
		contents, err := m.readBatch()
		switch {
		case err == nil:
			return contents, nil
		case errors.Is(err, ebpf.ErrNotSupported):
			m.noBatchLookup.Store(true)
		case errors.Is(err, unix.ENOSPC):
			// A hash bucket larger than the batch: iterate this time.
		default:
			return nil, fmt.Errorf("map %s: %w", m.m, err)
		}
	}
	contents, err := m.readIter()
	if err != nil {
		return nil, fmt.Errorf("map %s: %w", m.m, err)
	}
	return contents, nil
}

// lookupChunk bounds the memory a batch lookup needs.
const lookupChunk = 4096

func (m *Map[K, V]) readBatch() (map[K]V, error) {
	chunk := int(min(max(m.m.MaxEntries(), 1), lookupChunk))
	keys := make([]K, chunk)
	values := make([]V, chunk)
	contents := make(map[K]V)

	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.m.BatchLookup(&cursor, keys, values, nil)
		m.syscalls.Add(1)
		for i := range min(max(n, 0), chunk) {
			contents[keys[i]] = values[i]
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			// The kernel says so when it reached the end, even with
			// entries in this last chunk.
			return contents, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

func (m *Map[K, V]) readIter() (map[K]V, error) {
	var (
		key, next K
		value     V
	)
	contents := make(map[K]V)
	// Deletions by others during the walk can make the kernel restart it;
	// bound it instead of looping forever.
	limit := 2*int(m.m.MaxEntries()) + 16
	for i := 0; ; i++ {
		if i > limit {
			return nil, errors.New("iterate: map changed too much while being read")
		}
		var err error
		if i == 0 {
			err = m.m.NextKey(nil, &next)
		} else {
			err = m.m.NextKey(&key, &next)
		}
		m.syscalls.Add(1)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return contents, nil
		}
		if err != nil {
			return nil, fmt.Errorf("iterate: %w", err)
		}
		key = next
		err = m.m.Lookup(&key, &value)
		m.syscalls.Add(1)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue // deleted meanwhile
		}
		if err != nil {
			return nil, fmt.Errorf("iterate: %w", err)
		}
		contents[key] = value
	}
}

// lastIndex maps each key to the index of its last occurrence, or returns nil
// when there is at most one item and thus nothing to deduplicate.
func lastIndex[T any, K comparable](items []T, key func(T) K) map[K]int {
	if len(items) < 2 {
		return nil
	}
	last := make(map[K]int, len(items))
	for i, it := range items {
		last[key(it)] = i
	}
	return last
}

// shareResults gives earlier occurrences of a key the result of the last one.
func shareResults[T any, K comparable](items []T, last map[K]int, errs []error, key func(T) K) {
	if last == nil || len(last) == len(items) {
		return
	}
	for i, it := range items {
		if j := last[key(it)]; j != i {
			errs[i] = errs[j]
		}
	}
}
