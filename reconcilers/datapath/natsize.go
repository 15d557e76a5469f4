package datapath

import (
	"bufio"
	"log/slog"
	"runtime/debug"

	"github.com/cilium/hive/cell"

	"errors"
	"fmt"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"github.com/ipmasq/ipmasq/internal/cgroupmem"
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

// Where the default NAT size stops: under a container memory limit (the
// agent's own cgroup, internal/cgroupmem) the maps get no more than fits
// beside the Go heap, since the kernel charges their memory to the
// container as they fill, and a 32-core node whose kube-proxy set nf_conntrack_max
// to 32 768 per core would otherwise get 2 097 152 entries a family: more
// kernel memory than a 512 Mi limit holds.

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
// look it up, so it exists. At the enabled family's size its buckets
// alone would take kernel memory, charged to the agent, for nothing. Enabling the family at a restart resizes the map as a changed
// --nat-max-entries does.
const disabledFamilyNATEntries = 1024

// Kernel memory of the NAT maps per entry, charged to the agent's cgroup
// (kernels since 5.11; bpftool's memlock, as if full): an entry of the
// family's NAT map and its quarter of an unmasq record (bpf.UnmasqEntries).
const (
	natEntryBytesV4 = 104 + 96/4
	natEntryBytesV6 = 152 + 120/4
)

// Under a container memory limit the NAT maps get what the Go heap and the
// rest leave: goRoomMin or a quarter of the limit (whichever is more) for
// the Go heap unless GOMEMLIMIT says how much, and natSlack for what
// neither counts (the binary's pages, thread stacks, the other maps: the
// nonmasq tries, a disabled family's NAT map, fragments, counters).
// minLimitedNATEntries is the floor: below it the limit is too small for
// the agent, which says so.
const (
	goRoomMin            = 128 << 20
	natSlack             = 48 << 20
	minLimitedNATEntries = 4096
)

// natInputs is what the NAT maps are sized from.
type natInputs struct {
	// Configured is --nat-max-entries (0: size from the node).
	Configured uint32
	// Meminfo and ConntrackMax are the files of the node's memory and
	// conntrack limit (--nf-conntrack-max-path).
	Meminfo, ConntrackMax string
	// Limit is the agent's cgroup memory limit (Bytes 0: none); LimitErr
	// why it could not be read.
	Limit    cgroupmem.Limit
	LimitErr error
	// GoMemLimit is the Go heap's soft limit GOMEMLIMIT set (0: not set).
	GoMemLimit int64
	// IPv4, IPv6: the enabled families.
	IPv4, IPv6 bool
}

// natSizing is how the NAT maps' size was decided, for the log and status.
type natSizing struct {
	Entries      uint32
	Configured   bool
	RAM          uint64 // bytes
	ConntrackMax uint64 // 0: not read (no conntrack on the node)
	ConntrackSrc string // the file it was read from
	// Wanted is the size the node's conntrack asks for, before the limit.
	Wanted uint32
	// Limit is the cgroup memory limit; GoRoom and Budget what was left
	// to the Go heap and to the NAT maps under it.
	Limit          cgroupmem.Limit
	LimitErr       string
	GoRoom, Budget int64
	// CappedByLimit: Entries is below Wanted to fit the limit;
	// OverBudget: a configured size does not fit it; TooSmall: the limit
	// leaves less than the floor.
	CappedByLimit, OverBudget, TooSmall bool
	// NoIPv4, NoIPv6: the family is disabled, its map has
	// disabledFamilyNATEntries entries.
	NoIPv4, NoIPv6 bool
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

// entryBytes is the kernel memory of one entry in each enabled family's map.
func entryBytes(ipv4, ipv6 bool) int64 {
	var b int64
	if ipv4 {
		b += natEntryBytesV4
	}
	if ipv6 {
		b += natEntryBytesV6
	}
	return b
}

// Bytes is the kernel memory of the NAT maps (and their unmasq records).
func (s natSizing) Bytes() int64 {
	return int64(s.V4())*natEntryBytesV4 + int64(s.V6())*natEntryBytesV6
}

// GoSoftLimit is the Go heap's soft limit that keeps the agent under its
// cgroup's limit with the NAT maps in it (0: no limit to keep under).
func (s natSizing) GoSoftLimit() int64 {
	if s.Limit.Bytes == 0 {
		return 0
	}
	return max(s.Limit.Bytes-s.Bytes()-natSlack, goRoomMin/2)
}

func (s natSizing) String() string {
	var why string
	mib := func(b int64) int64 { return b >> 20 }
	if s.Configured {
		why = fmt.Sprintf("%d entries per family (--nat-max-entries)", s.Entries)
	} else {
		ct := "conntrack not loaded"
		if s.ConntrackMax > 0 {
			ct = fmt.Sprintf("nf_conntrack_max %d from %s", s.ConntrackMax, s.ConntrackSrc)
		}
		why = fmt.Sprintf("%d entries per family: two per flow of max(Linux's default nf_conntrack_max for %d MiB of memory (%d), %s)",
			s.Wanted, s.RAM>>20, conntrackDefaultMax(s.RAM), ct)
		if s.CappedByLimit {
			why = fmt.Sprintf("%d entries per family, fewer than the %s", s.Entries, why)
		}
	}
	switch {
	case s.LimitErr != "":
		why += "; container memory limit unknown (" + s.LimitErr + "): not bounded by it"
	case s.Limit.Bytes == 0:
		why += "; " + s.Limit.String() + ": not bounded by one"
	default:
		why += fmt.Sprintf("; container memory limit %s: %d MiB for the Go heap, %d MiB for the rest, %d MiB for the NAT maps (they take %d MiB)",
			s.Limit, mib(s.GoRoom), mib(natSlack), mib(max(s.Budget, 0)), mib(s.Bytes()))
		switch {
		case s.TooSmall:
			why += fmt.Sprintf(": TOO SMALL for the agent, the maps get the floor of %d entries; raise the limit", minLimitedNATEntries)
		case s.OverBudget:
			why += ": OVER the budget, the agent may be OOM-killed; lower --nat-max-entries or raise the limit"
		}
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
// as is, said when it does not fit the memory limit), else
// defaultNATEntries of the node's memory and conntrack limit, read from
// the files of in (a missing conntrack file means the node has no
// conntrack), and no more than fit the cgroup's memory limit beside the Go
// heap.
func sizeNATMaps(in natInputs) (natSizing, error) {
	s := natSizing{Limit: in.Limit, NoIPv4: !in.IPv4, NoIPv6: !in.IPv6}
	if in.LimitErr != nil {
		s.LimitErr = in.LimitErr.Error()
	}
	per := entryBytes(in.IPv4, in.IPv6)
	if s.Limit.Bytes > 0 {
		s.GoRoom = max(goRoomMin, s.Limit.Bytes/4)
		if in.GoMemLimit > 0 {
			s.GoRoom = in.GoMemLimit
		}
		s.Budget = s.Limit.Bytes - s.GoRoom - natSlack
	}
	if in.Configured != 0 {
		s.Entries, s.Configured = in.Configured, true
		s.OverBudget = s.Limit.Bytes > 0 && int64(s.Entries)*per > s.Budget
		return s, nil
	}
	ram, err := readMemTotal(in.Meminfo)
	if err != nil {
		return natSizing{}, fmt.Errorf("--nat-max-entries=0 sizes the NAT maps from the node's memory: %w", err)
	}
	s.RAM = ram
	data, err := os.ReadFile(in.ConntrackMax)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return natSizing{}, fmt.Errorf("--nf-conntrack-max-path=%s (read with --nat-max-entries=0): %w", in.ConntrackMax, err)
	default:
		if s.ConntrackMax, err = strconv.ParseUint(strings.TrimSpace(string(data)), 10, 64); err != nil {
			return natSizing{}, fmt.Errorf("--nf-conntrack-max-path=%s (read with --nat-max-entries=0) holds %q, not a number", in.ConntrackMax, strings.TrimSpace(string(data)))
		}
		s.ConntrackSrc = in.ConntrackMax
	}
	s.Wanted = defaultNATEntries(s.RAM, s.ConntrackMax)
	s.Entries = s.Wanted
	if s.Limit.Bytes > 0 && per > 0 {
		fit := s.Budget / per / 1024 * 1024 // whole KiEntries
		switch {
		case fit < minLimitedNATEntries:
			s.Entries, s.CappedByLimit, s.TooSmall = minLimitedNATEntries, true, true
		case fit < int64(s.Wanted):
			s.Entries, s.CappedByLimit = uint32(fit), true
		}
	}
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

type sizingParams struct {
	cell.In

	Log    *slog.Logger
	Agent  settings.Config
	Config Config
}

// newNATSizing sizes the NAT maps (sizeNATMaps) from the node's files, the
// agent's cgroup memory limit and GOMEMLIMIT, and, unless GOMEMLIMIT is
// set, lowers the Go heap's soft limit so that heap and maps together stay
// under the cgroup's limit.
func newNATSizing(p sizingParams) (natSizing, tables.NATSizing, error) {
	in := natInputs{
		Configured: p.Config.NATMaxEntries, Meminfo: meminfoPath, ConntrackMax: p.Config.ConntrackMaxPath,
		IPv4: p.Agent.EnableIPv4, IPv6: p.Agent.EnableIPv6,
	}
	in.Limit, in.LimitErr = cgroupmem.Read(cgroupmem.ProcSelfCgroup, cgroupmem.Root)
	env, goSet := os.LookupEnv("GOMEMLIMIT")
	goSet = goSet && env != "off"
	if goSet {
		// The runtime has parsed it already.
		in.GoMemLimit = debug.SetMemoryLimit(-1)
	}
	s, err := sizeNATMaps(in)
	if err != nil {
		return natSizing{}, tables.NATSizing{}, err
	}
	if soft := s.GoSoftLimit(); soft > 0 && !goSet {
		if cur := debug.SetMemoryLimit(-1); soft < cur {
			debug.SetMemoryLimit(soft)
			p.Log.Info("Go memory limit lowered for the NAT maps", "goMemoryLimitMiB", soft>>20, "natMapsMiB", s.Bytes()>>20, "cgroupLimit", s.Limit.String())
		}
	}
	return s, tables.NATSizing{Summary: s.String()}, nil
}
