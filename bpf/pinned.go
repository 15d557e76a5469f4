package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cilium/ebpf"
)

// ErrNotPinned is returned by Pinned's readers when the map they read is not
// pinned (yet): the agent has not loaded the datapath under that directory.
var ErrNotPinned = errors.New("datapath maps not pinned")

// Pinned reads the datapath's pinned maps read-only. Readers (metrics,
// status, the CLI) use it instead of a handle that a reconciler fills in
// its start hook: they depend on the pins, not on the agent's start order.
// Each call opens the maps it reads and closes them again, unless the
// Pinned is Cached.
type Pinned struct {
	// Dir is the pin directory, <bpf-root>/ipmasq.
	Dir string

	cache *pinCache
}

// Cached returns p keeping the maps it opens open between calls, for a
// reader that reads them over and over (the metrics' scrape): opening a
// pinned map costs four syscalls, and a scrape reads eight maps. Each
// later call checks with one fstatat (relative to the pin directory, kept
// open) that the pin still names the map held (a datapath loaded again
// pins new maps, and a resized NAT map is a new map) and opens the new one
// if not; a map whose pin is gone is released by the next call that reads
// it, and every map (and the directory) by Close. Safe for concurrent use.
func (p Pinned) Cached() Pinned {
	p.cache = &pinCache{pins: map[string]*cachedPin{}, held: map[*ebpf.Map]*cachedPin{}, dirFD: -1}
	return p
}

// Close releases the maps a Cached Pinned holds (those being read are
// closed when their read ends). It may be used again afterwards: it opens
// them again. Close of an uncached Pinned does nothing.
func (p Pinned) Close() error {
	if p.cache != nil {
		p.cache.closeAll()
	}
	return nil
}

func (p Pinned) open(name string) (*ebpf.Map, error) {
	path := filepath.Join(p.Dir, name)
	if p.cache != nil {
		return p.cache.open(path, name, p.Dir)
	}
	return openPinned(path, name, p.Dir)
}

// mapID is m's ID (m from open), kept with the map when it is cached.
func (p Pinned) mapID(m *ebpf.Map) (ebpf.MapID, error) {
	if p.cache != nil {
		p.cache.mu.Lock()
		e := p.cache.held[m]
		if e != nil && e.id != 0 {
			p.cache.mu.Unlock()
			return e.id, nil
		}
		p.cache.mu.Unlock()
		id, err := mapID(m)
		if err == nil && e != nil {
			p.cache.mu.Lock()
			e.id = id
			p.cache.mu.Unlock()
		}
		return id, err
	}
	return mapID(m)
}

// release ends a read of a map open returned.
func (p Pinned) release(m *ebpf.Map) {
	if p.cache == nil || !p.cache.release(m) {
		m.Close()
	}
}

func openPinned(path, name, dir string) (*ebpf.Map, error) {
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s in %s: %w", name, dir, ErrNotPinned)
	}
	if err != nil {
		return nil, fmt.Errorf("open pinned %s: %w", name, err)
	}
	return m, nil
}

// pinCache holds the maps a Cached Pinned opened, by pin path.
type pinCache struct {
	mu   sync.Mutex
	pins map[string]*cachedPin
	held map[*ebpf.Map]*cachedPin
	// dirFD is the pin directory (O_PATH), -1 until opened.
	dirFD int
}

// cachedPin is one open map and the pin's inode it was opened from.
type cachedPin struct {
	m        *ebpf.Map
	dev, ino uint64
	// readers counts the reads under way; a stale map (its pin replaced
	// or gone, or the cache closed) is closed when the last one ends.
	readers int
	stale   bool
	// id is the map's ID once asked for (0: not yet).
	id ebpf.MapID
}

func (c *pinCache) open(path, name, dir string) (*ebpf.Map, error) {
	c.mu.Lock()
	before, err := c.statLocked(dir, name)
	if err == nil {
		if e := c.pins[path]; e != nil && e.dev == before.Dev && e.ino == before.Ino {
			e.readers++
			c.mu.Unlock()
			return e.m, nil
		}
	} else {
		c.dropLocked(path)
	}
	c.mu.Unlock()
	if errors.Is(err, unix.ENOENT) {
		return nil, fmt.Errorf("%s in %s: %w", name, dir, ErrNotPinned)
	}
	if err != nil {
		return nil, fmt.Errorf("open pinned %s: %w", name, err)
	}
	m, err := openPinned(path, name, dir)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	after, err := c.statLocked(dir, name)
	if err != nil || after.Dev != before.Dev || after.Ino != before.Ino {
		// The pin changed while it was opened: not known to be the map of
		// either inode, so not kept (release closes it).
		return m, nil
	}
	c.dropLocked(path)
	e := &cachedPin{m: m, dev: before.Dev, ino: before.Ino, readers: 1}
	c.pins[path], c.held[m] = e, e
	return m, nil
}

// statLocked stats the pin name of dir relative to the directory, opened
// once (a path walk of one name, not of the whole path). A name not found
// is looked up once more through dir's path, in case the directory itself
// was replaced.
func (c *pinCache) statLocked(dir, name string) (unix.Stat_t, error) {
	var st unix.Stat_t
	for retry := false; ; retry = true {
		if c.dirFD < 0 {
			fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				return st, err
			}
			c.dirFD = fd
		}
		err := unix.Fstatat(c.dirFD, name, &st, unix.AT_SYMLINK_NOFOLLOW)
		if err == nil || retry || !errors.Is(err, unix.ENOENT) {
			return st, err
		}
		unix.Close(c.dirFD)
		c.dirFD = -1
	}
}

// release ends a read of m; false: m is not the cache's (the caller closes
// it).
func (c *pinCache) release(m *ebpf.Map) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.held[m]
	if e == nil {
		return false
	}
	e.readers--
	c.closeIfDoneLocked(e)
	return true
}

func (c *pinCache) closeAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for path := range c.pins {
		c.dropLocked(path)
	}
	if c.dirFD >= 0 {
		unix.Close(c.dirFD)
		c.dirFD = -1
	}
}

// dropLocked takes path's map out of the cache, closing it unless a read
// is under way.
func (c *pinCache) dropLocked(path string) {
	if e := c.pins[path]; e != nil {
		delete(c.pins, path)
		e.stale = true
		c.closeIfDoneLocked(e)
	}
}

func (c *pinCache) closeIfDoneLocked(e *cachedPin) {
	if e.stale && e.readers == 0 {
		delete(c.held, e.m)
		e.m.Close()
	}
}

// NonMasq returns the entries of the nonmasq trie name (MapNonMasqV4 or
// MapNonMasqV6): prefix → action (0 do not masquerade, 1 masquerade), as
// the kernel holds them.
func (p Pinned) NonMasq(name string) (map[netip.Prefix]uint8, error) {
	if name != MapNonMasqV4 && name != MapNonMasqV6 {
		return nil, fmt.Errorf("%s is not a non-masquerade map (want %s or %s)", name, MapNonMasqV4, MapNonMasqV6)
	}
	m, err := p.open(name)
	if err != nil {
		return nil, err
	}
	defer p.release(m)
	out := map[netip.Prefix]uint8{}
	var v uint8
	var it *ebpf.MapIterator
	if name == MapNonMasqV4 {
		var k LPMKeyV4
		for it = m.Iterate(); it.Next(&k, &v); {
			out[k.Prefix()] = v
		}
	} else {
		var k LPMKeyV6
		for it = m.Iterate(); it.Next(&k, &v); {
			out[k.Prefix()] = v
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	return out, nil
}

// Counters returns the datapath counters summed over CPUs, indexed by
// Counter.
func (p Pinned) Counters() ([]uint64, error) {
	m, err := p.open(MapCounters)
	if err != nil {
		return nil, err
	}
	defer p.release(m)
	return ReadCounters(m)
}

// CountEntries counts a map's entries, reading it in batches where the
// kernel has them (one buffer of natReadChunk entries, whatever the map's
// size), entry by entry otherwise.
func CountEntries[K, V comparable](m *ebpf.Map) (int, error) {
	n := 0
	err := readBatches(m, m.String(), func(K, V) bool { n++; return true })
	return n, err
}

// NonMasqEntries returns the entries of the non-masquerade maps, per
// family; a family whose map is not pinned (disabled) is left out, and
// ErrNotPinned means neither is.
func (p Pinned) NonMasqEntries() (map[string]int, error) {
	out := map[string]int{}
	for _, f := range []struct {
		family, name string
		count        func(*ebpf.Map) (int, error)
	}{
		{"ipv4", MapNonMasqV4, CountEntries[LPMKeyV4, uint8]},
		{"ipv6", MapNonMasqV6, CountEntries[LPMKeyV6, uint8]},
	} {
		m, err := p.open(f.name)
		if errors.Is(err, ErrNotPinned) {
			continue
		}
		if err != nil {
			return nil, err
		}
		n, err := f.count(m)
		p.release(m)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		out[f.family] = n
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s, %s in %s: %w", MapNonMasqV4, MapNonMasqV6, p.Dir, ErrNotPinned)
	}
	return out, nil
}

// NATPairs calls visit for every NAT pair, inbound record and node flow
// hold of both families (IPv4 first), until visit returns false. See
// ReadNATPairsV4; the datapath's counts of the reply entries size its
// index.
func (p Pinned) NATPairs(visit func(*NATPair) bool) error {
	replies := [2]int{}
	if counts, err := p.NATCounts(); err == nil {
		replies[0], replies[1] = max(counts[0].Reply, 0), max(counts[1].Reply, 0)
	}
	stopped := false
	for i, f := range []struct {
		name string
		read func(*ebpf.Map, int, func(*NATPair) bool) error
	}{
		{MapNATV4, func(m *ebpf.Map, n int, v func(*NATPair) bool) error { return readNATPairs(m, natV4, n, v) }},
		{MapNATV6, func(m *ebpf.Map, n int, v func(*NATPair) bool) error { return readNATPairs(m, natV6, n, v) }},
	} {
		m, err := p.open(f.name)
		if err != nil {
			return err
		}
		err = f.read(m, replies[i], func(np *NATPair) bool {
			stopped = !visit(np)
			return !stopped
		})
		p.release(m)
		if err != nil || stopped {
			return err
		}
	}
	return nil
}

// Lifetimes returns the NAT lifetimes the programs apply (the agent's
// --nat-timeout-* flags, as written to the config map).
func (p Pinned) Lifetimes() (Lifetimes, error) {
	m, err := p.open(MapConfig)
	if err != nil {
		return Lifetimes{}, err
	}
	defer p.release(m)
	return LifetimesOf(m)
}

// NATMapFill is the occupancy of one NAT map (or one map of the records
// of unmasqueraded flows, see UnmasqFill).
type NATMapFill struct {
	// Family is "ipv4" (nat_v4) or "ipv6" (nat_v6).
	Family string `json:"family"`
	// Entries counts both entries of each pair, inbound records and node
	// flow holds; Capacity is the map's max_entries (--nat-max-entries).
	Entries  int `json:"entries"`
	Capacity int `json:"capacity"`
}

// NATFill returns the occupancy of nat_v4 and nat_v6, in that order: the
// programs' counts (NATCounts), so it costs the same at any size of the
// maps.
func (p Pinned) NATFill() ([]NATMapFill, error) {
	counts, err := p.NATCounts()
	if err != nil {
		return nil, err
	}
	var out []NATMapFill
	for i, name := range []string{MapNATV4, MapNATV6} {
		m, err := p.open(name)
		if err != nil {
			return nil, err
		}
		out = append(out, NATMapFill{Family: counts[i].Family, Entries: counts[i].Entries(), Capacity: int(m.MaxEntries())})
		p.release(m)
	}
	return out, nil
}

// UnmasqFill returns the occupancy of unmasq_v4 and unmasq_v6, in that
// order: the records of flows that started unmasqueraded, whose decision
// they keep (lib/unmasq.h). Entries is one per flow, as the kernel counts
// them (ElemCounts: an LRU's evictions included, at the same cost at any
// size); Capacity is UnmasqEntries of --nat-max-entries. The maps are
// LRUs: a full one evicts its least recently used record, whose flow is
// then decided again.
func (p Pinned) UnmasqFill() ([]NATMapFill, error) {
	var (
		out  []NATMapFill
		ids  []ebpf.MapID
		maps []*ebpf.Map
	)
	defer func() {
		for _, m := range maps {
			p.release(m)
		}
	}()
	for _, f := range []struct{ family, name string }{{"ipv4", MapUnmasqV4}, {"ipv6", MapUnmasqV6}} {
		m, err := p.open(f.name)
		if err != nil {
			return nil, err
		}
		maps = append(maps, m)
		id, err := p.mapID(m)
		if err != nil {
			return nil, err
		}
		ids = append(ids, id)
		out = append(out, NATMapFill{Family: f.family, Capacity: int(m.MaxEntries())})
	}
	counts, err := ElemCounts(ids...)
	if err != nil {
		// A kernel without bpf_map_sum_elem_count (before 6.6): a walk,
		// whose cost follows the maps' capacity.
		if out[0].Entries, err = CountEntries[NATKeyV4, UnmasqVal](maps[0]); err != nil {
			return nil, fmt.Errorf("%s: %w", MapUnmasqV4, err)
		}
		if out[1].Entries, err = CountEntries[NATKeyV6, UnmasqVal](maps[1]); err != nil {
			return nil, fmt.Errorf("%s: %w", MapUnmasqV6, err)
		}
		return out, nil
	}
	for i, id := range ids {
		out[i].Entries = counts[id]
	}
	return out, nil
}
