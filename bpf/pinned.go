package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// ErrNotPinned is returned by Pinned's readers when the map they read is not
// pinned (yet): the agent has not loaded the datapath under that directory.
var ErrNotPinned = errors.New("datapath maps not pinned")

// Pinned reads the datapath's pinned maps read-only. Readers (metrics,
// status, the CLI) use it instead of a handle that a reconciler fills in
// its start hook: they depend on the pins, not on the agent's start order.
// Each call opens the maps it reads and closes them again.
type Pinned struct {
	// Dir is the pin directory, <bpf-root>/ipmasq.
	Dir string
}

func (p Pinned) open(name string) (*ebpf.Map, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(p.Dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s in %s: %w", name, p.Dir, ErrNotPinned)
	}
	if err != nil {
		return nil, fmt.Errorf("open pinned %s: %w", name, err)
	}
	return m, nil
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
	defer m.Close()
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
	defer m.Close()
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
		m.Close()
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
// ReadNATPairsV4.
func (p Pinned) NATPairs(visit func(*NATPair) bool) error {
	stopped := false
	for _, f := range []struct {
		name string
		read func(*ebpf.Map, func(*NATPair) bool) error
	}{{MapNATV4, ReadNATPairsV4}, {MapNATV6, ReadNATPairsV6}} {
		m, err := p.open(f.name)
		if err != nil {
			return err
		}
		err = f.read(m, func(np *NATPair) bool {
			stopped = !visit(np)
			return !stopped
		})
		m.Close()
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
	defer m.Close()
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
		m.Close()
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
			m.Close()
		}
	}()
	for _, f := range []struct{ family, name string }{{"ipv4", MapUnmasqV4}, {"ipv6", MapUnmasqV6}} {
		m, err := p.open(f.name)
		if err != nil {
			return nil, err
		}
		maps = append(maps, m)
		id, err := mapID(m)
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
