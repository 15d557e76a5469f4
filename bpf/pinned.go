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

// NATOccupancy returns the entries in the IPv4 and IPv6 NAT maps and the
// capacity of each (two entries per flow).
func (p Pinned) NATOccupancy() (v4, v6, capacity int, err error) {
	m4, err := p.open(MapNATV4)
	if err != nil {
		return 0, 0, 0, err
	}
	defer m4.Close()
	m6, err := p.open(MapNATV6)
	if err != nil {
		return 0, 0, 0, err
	}
	defer m6.Close()
	if v4, err = CountEntries[NATKeyV4, NATValV4](m4); err != nil {
		return 0, 0, 0, fmt.Errorf("%s: %w", MapNATV4, err)
	}
	if v6, err = CountEntries[NATKeyV6, NATValV6](m6); err != nil {
		return 0, 0, 0, fmt.Errorf("%s: %w", MapNATV6, err)
	}
	return v4, v6, int(m4.MaxEntries()), nil
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

// NATFill returns the occupancy of nat_v4 and nat_v6, in that order.
func (p Pinned) NATFill() ([]NATMapFill, error) {
	return p.fill([]mapOfFamily{
		{"ipv4", MapNATV4, CountEntries[NATKeyV4, NATValV4]},
		{"ipv6", MapNATV6, CountEntries[NATKeyV6, NATValV6]},
	})
}

// UnmasqFill returns the occupancy of unmasq_v4 and unmasq_v6, in that
// order: the records of flows that started unmasqueraded, whose decision
// they keep (lib/unmasq.h). Entries is one per flow; Capacity is
// UnmasqEntries of --nat-max-entries. The maps are LRUs: a full one evicts
// its least recently used record, whose flow is then decided again.
func (p Pinned) UnmasqFill() ([]NATMapFill, error) {
	return p.fill([]mapOfFamily{
		{"ipv4", MapUnmasqV4, CountEntries[NATKeyV4, UnmasqVal]},
		{"ipv6", MapUnmasqV6, CountEntries[NATKeyV6, UnmasqVal]},
	})
}

// mapOfFamily is a map of one family and how to count its entries.
type mapOfFamily struct {
	family, name string
	count        func(*ebpf.Map) (int, error)
}

func (p Pinned) fill(maps []mapOfFamily) ([]NATMapFill, error) {
	var out []NATMapFill
	for _, f := range maps {
		m, err := p.open(f.name)
		if err != nil {
			return nil, err
		}
		n, err := f.count(m)
		capacity := int(m.MaxEntries())
		m.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		out = append(out, NATMapFill{Family: f.family, Entries: n, Capacity: capacity})
	}
	return out, nil
}
