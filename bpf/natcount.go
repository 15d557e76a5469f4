package bpf

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// MapNATCount is the per-CPU count of the NAT maps' entries by family and
// class (lib/natcount.h), pinned with the other maps.
const MapNATCount = masqMapNatCount

// NAT entry classes: enum nat_class in lib/natcount.h.
const (
	natClassEgress  = int(masqNatClassNAT_CLASS_EGRESS)
	natClassReply   = int(masqNatClassNAT_CLASS_REPLY)
	natClassInbound = int(masqNatClassNAT_CLASS_INBOUND)
	natClassHost    = int(masqNatClassNAT_CLASS_HOST)
	numNATClasses   = int(masqNatClassNAT_CLASS_MAX)
)

// NATCounts are one family's NAT entries by class, as the programs count
// them on every insert and delete (lib/natcount.h), the way conntrack keeps
// nf_conntrack_count: reading them costs the same at any size of the map.
type NATCounts struct {
	// Family is "ipv4" (nat_v4) or "ipv6" (nat_v6).
	Family string `json:"family"`
	// Masquerade are the translated flows (their egress entries), Reply
	// their reply entries (a pair whose reply entry is gone has none),
	// Inbound the inbound flow records and Host the node flows' held
	// tuples.
	Masquerade int `json:"masquerade"`
	Reply      int `json:"reply"`
	Inbound    int `json:"inbound"`
	Host       int `json:"host"`
}

// Entries is the number of entries in the family's map.
func (c NATCounts) Entries() int { return c.Masquerade + c.Reply + c.Inbound + c.Host }

// Pairs is the number of records the listing shows (ipmasq-agent nat, one
// per translated flow, inbound record and node flow hold): what nat -C
// counts.
func (c NATCounts) Pairs() int { return c.Masquerade + c.Inbound + c.Host }

// Of returns the count of a listing's kind.
func (c NATCounts) Of(k NATKind) int {
	switch k {
	case KindMasquerade:
		return c.Masquerade
	case KindInbound:
		return c.Inbound
	case KindHost:
		return c.Host
	}
	return 0
}

// ReadNATCounts sums nat_count over CPUs: the IPv4 counts, then IPv6.
func ReadNATCounts(m *ebpf.Map) ([]NATCounts, error) {
	sums, err := SumPerCPU(m, 2*numNATClasses)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", MapNATCount, err)
	}
	out := []NATCounts{{Family: "ipv4"}, {Family: "ipv6"}}
	for fam := range out {
		// Each sum mod 2^64: a CPU's share may be below zero.
		n := func(class int) int { return int(int64(sums[fam*numNATClasses+class])) }
		out[fam].Masquerade, out[fam].Reply = n(natClassEgress), n(natClassReply)
		out[fam].Inbound, out[fam].Host = n(natClassInbound), n(natClassHost)
	}
	return out, nil
}

// NATCounts reads the programs' counts of nat_v4 and nat_v6, in that order.
func (p Pinned) NATCounts() ([]NATCounts, error) {
	m, err := p.open(MapNATCount)
	if err != nil {
		return nil, err
	}
	defer p.release(m)
	return ReadNATCounts(m)
}

// CountNATEntries counts a NAT map's entries by class with a full walk (in
// batches): what the programs' counts must equal when nothing runs. The
// loader uses it to start the counts of a map it did not count from empty,
// tests to check the counts.
func CountNATEntries(m *ebpf.Map, ipv6 bool) (NATCounts, error) {
	var n [numNATClasses]int
	class := func(dir, flags uint8) int {
		switch {
		case dir == DirEgress:
			return natClassEgress
		case dir == DirIngress && flags&NATFlagHost != 0:
			return natClassHost
		case dir == DirIngress:
			return natClassReply
		}
		return natClassInbound
	}
	var err error
	out := NATCounts{Family: "ipv4"}
	if ipv6 {
		out.Family = "ipv6"
		err = readBatches(m, MapNATV6, func(k NATKeyV6, v NATValV6) bool { n[class(k.Dir, v.Flags)]++; return true })
	} else {
		err = readBatches(m, MapNATV4, func(k NATKeyV4, v NATValV4) bool { n[class(k.Dir, v.Flags)]++; return true })
	}
	out.Masquerade, out.Reply, out.Inbound, out.Host = n[natClassEgress], n[natClassReply], n[natClassInbound], n[natClassHost]
	return out, err
}

// SetNATCounts makes the counts of nat_count equal c (held on the first
// CPU): for a NAT map filled from user space (a copy into a resized map,
// a benchmark's direct writes), which the programs did not count.
func SetNATCounts(m *ebpf.Map, c NATCounts) error {
	fam := 0
	if c.Family == "ipv6" {
		fam = 1
	}
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return err
	}
	for class, v := range map[int]int{natClassEgress: c.Masquerade, natClassReply: c.Reply,
		natClassInbound: c.Inbound, natClassHost: c.Host} {
		perCPU := make([]uint64, cpus)
		perCPU[0] = uint64(int64(v))
		if err := m.Put(uint32(fam*numNATClasses+class), perCPU); err != nil {
			return fmt.Errorf("write %s: %w", MapNATCount, err)
		}
	}
	return nil
}

// pinnedIDs returns the IDs of the maps pinned under dir by name (0: none).
func pinnedIDs(dir string, names ...string) map[string]ebpf.MapID {
	out := map[string]ebpf.MapID{}
	for _, name := range names {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			continue
		}
		if info, err := m.Info(); err == nil {
			if id, ok := info.ID(); ok {
				out[name] = id
			}
		}
		m.Close()
	}
	return out
}

// recountNAT starts the counts of each NAT map that the programs did not
// count from empty: every map when nat_count is new (the first start of a
// version with counts), and a NAT map that Load replaced (resized, its
// pairs copied from user space). A reused map keeps its counts: a restart
// under traffic changes nothing.
func recountNAT(d *Datapath, before map[string]ebpf.MapID) error {
	var errs []error
	for _, f := range []struct {
		name string
		m    *ebpf.Map
		ipv6 bool
	}{{MapNATV4, d.Maps.NatV4, false}, {MapNATV6, d.Maps.NatV6, true}} {
		if before[MapNATCount] != 0 && before[f.name] != 0 {
			info, err := f.m.Info()
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if id, ok := info.ID(); ok && id == before[f.name] {
				continue
			}
		}
		c, err := CountNATEntries(f.m, f.ipv6)
		if err == nil {
			err = SetNATCounts(d.Maps.NatCount, c)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("count %s: %w", f.name, err))
		}
	}
	return errors.Join(errs...)
}
