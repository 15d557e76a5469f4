package datapath

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
)

// Where the default NAT table size comes from. Linux sizes conntrack from
// the node's memory (nf_conntrack_init_start: a hash bucket per 16 KiB of
// RAM up to 1 GiB, 65 536 up to 4 GiB, 262 144 above, at least 1 024, and
// nf_conntrack_max equal to the bucket count); Cilium sizes its maps as a
// share of total memory (--bpf-map-dynamic-size-ratio). The NAT maps hold
// at least the flows the node's conntrack would hold: Linux's default for
// this memory, or the node's nf_conntrack_max when it is higher (an
// operator raised it). Each flow takes two entries, and each family has a
// map of its own, so a single-family node holds as many flows as conntrack.
const (
	meminfoPath      = "/proc/meminfo"
	conntrackMaxPath = "/proc/sys/net/netfilter/nf_conntrack_max"
)

// maxNATEntries bounds the default: the kernel's hash maps take at most
// 2^31 entries; beyond 2^26 (64 Mi entries, several GiB of kernel memory
// per map) the default is more likely a misread than a node's need.
const maxNATEntries = 1 << 26

// conntrackDefaultMax is Linux's default nf_conntrack_max for a node with
// ram bytes of memory (net/netfilter/nf_conntrack_core.c,
// nf_conntrack_init_start, 64-bit).
func conntrackDefaultMax(ram uint64) uint64 {
	const gib = 1 << 30
	switch {
	case ram > 4*gib:
		return 262144
	case ram > gib:
		return 65536
	}
	// One 8-byte bucket per 16 KiB of memory.
	return max(ram/16384/8, 1024)
}

// defaultNATEntries is the size of each NAT map for a node with ram bytes
// of memory whose nf_conntrack_max is conntrackMax (0: conntrack not
// loaded): two entries per flow conntrack would hold.
func defaultNATEntries(ram, conntrackMax uint64) uint32 {
	flows := max(conntrackDefaultMax(ram), conntrackMax)
	return uint32(min(2*flows, maxNATEntries))
}

// disabledFamilyNATEntries sizes the NAT map of a disabled family
// (--enable-ipv4/--enable-ipv6 false): that family has no masquerade
// source and no masquerade rule, so its map holds no pair, yet the programs
// look it up, so it exists. Preallocated at the enabled family's size it
// would take up to 76 MiB of kernel memory, charged to the agent, for
// nothing. Enabling the family at a restart resizes the map as a changed
// --nat-max-entries does.
const disabledFamilyNATEntries = 1024

// natSizing is how the NAT maps' size was decided, for the log.
type natSizing struct {
	Entries      uint32
	Configured   bool
	RAM          uint64 // bytes
	ConntrackMax uint64 // 0: not read (no conntrack on the node)
	// NoIPv4, NoIPv6: the family is disabled, its map has
	// disabledFamilyNATEntries entries.
	NoIPv4, NoIPv6 bool
}

// forFamilies notes which families are disabled.
func (s natSizing) forFamilies(ipv4, ipv6 bool) natSizing {
	s.NoIPv4, s.NoIPv6 = !ipv4, !ipv6
	return s
}

// V4 and V6 are the sizes of nat_v4 and nat_v6.
func (s natSizing) V4() uint32 { return s.sizeOf(s.NoIPv4) }
func (s natSizing) V6() uint32 { return s.sizeOf(s.NoIPv6) }

func (s natSizing) sizeOf(disabled bool) uint32 {
	if disabled {
		return disabledFamilyNATEntries
	}
	return s.Entries
}

func (s natSizing) String() string {
	var why string
	if s.Configured {
		why = fmt.Sprintf("%d entries per family (--nat-max-entries)", s.Entries)
	} else {
		ct := "conntrack not loaded"
		if s.ConntrackMax > 0 {
			ct = fmt.Sprintf("nf_conntrack_max %d", s.ConntrackMax)
		}
		why = fmt.Sprintf("%d entries per family: two per flow of max(Linux's default nf_conntrack_max for %d MiB of memory (%d), %s)",
			s.Entries, s.RAM>>20, conntrackDefaultMax(s.RAM), ct)
	}
	for _, f := range []struct {
		off       bool
		name, flg string
	}{{s.NoIPv4, "nat_v4", "--enable-ipv4"}, {s.NoIPv6, "nat_v6", "--enable-ipv6"}} {
		if f.off {
			why += fmt.Sprintf("; %s has %d (%s=false: it holds no pair)", f.name, disabledFamilyNATEntries, f.flg)
		}
	}
	return why
}

// sizeNATMaps returns the size of each NAT map: configured when not 0 (kept
// as is), else defaultNATEntries of the node's memory and conntrack limit,
// read from meminfo and conntrackMax (a missing conntrackMax file means the
// node has no conntrack).
func sizeNATMaps(configured uint32, meminfo, conntrackMax string) (natSizing, error) {
	if configured != 0 {
		return natSizing{Entries: configured, Configured: true}, nil
	}
	ram, err := readMemTotal(meminfo)
	if err != nil {
		return natSizing{}, fmt.Errorf("--nat-max-entries=0 sizes the NAT maps from the node's memory: %w", err)
	}
	s := natSizing{RAM: ram}
	data, err := os.ReadFile(conntrackMax)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return natSizing{}, fmt.Errorf("--nat-max-entries=0: read %s: %w", conntrackMax, err)
	default:
		if s.ConntrackMax, err = strconv.ParseUint(strings.TrimSpace(string(data)), 10, 64); err != nil {
			return natSizing{}, fmt.Errorf("--nat-max-entries=0: %s holds %q, not a number", conntrackMax, strings.TrimSpace(string(data)))
		}
	}
	s.Entries = defaultNATEntries(s.RAM, s.ConntrackMax)
	return s, nil
}

// readMemTotal reads MemTotal (bytes) from a meminfo file.
func readMemTotal(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "MemTotal:       24683584 kB"
		fields := strings.Fields(sc.Text())
		if len(fields) == 3 && fields[0] == "MemTotal:" && fields[2] == "kB" {
			kib, err := strconv.ParseUint(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("%s: MemTotal %q is not a number", path, fields[1])
			}
			return kib << 10, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	return 0, fmt.Errorf("%s has no MemTotal line", path)
}
