package datapath

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/bpf"
)

// Config is the datapath's command-line configuration.
type Config struct {
	// NATPortRange is the range of source ports (and ICMP echo ids)
	// masqueraded flows get when their own port is taken, "min-max", or
	// several ranges "a-b,c-d" (ParsePortRanges).
	NATPortRange string `mapstructure:"nat-port-range"`
	// NATKeepSourcePort: a TCP or UDP flow keeps its own source port (from
	// 1024) when no other flow and no node socket holds that port toward its
	// destination, as Linux MASQUERADE does; the range serves the others.
	NATKeepSourcePort bool `mapstructure:"nat-keep-source-port"`
	// NATRandomFully: a TCP or UDP flow gets a random port of its space,
	// its own port never tried first (MASQUERADE --random-fully, set by
	// the Kubernetes agent's --random-fully).
	NATRandomFully bool `mapstructure:"nat-random-fully"`
	// NATMaxEntries sizes each NAT map; a flow takes two entries. 0 (the
	// default) sizes them from the node's memory and conntrack limit
	// (sizeNATMaps).
	NATMaxEntries uint32 `mapstructure:"nat-max-entries"`
	// ConntrackMaxPath is the file the node's conntrack limit is read from
	// when --nat-max-entries is 0 (absent: no conntrack).
	ConntrackMaxPath string `mapstructure:"nf-conntrack-max-path"`
	// NATGCInterval is how often idle NAT entries are expired.
	NATGCInterval time.Duration `mapstructure:"nat-gc-interval"`
	// TCAttachMode is how programs are attached: auto, tcx or clsact.
	TCAttachMode string `mapstructure:"tc-attach-mode"`
	// DatapathVariant is the build of the programs loaded: auto, full or
	// compat (bpf.ChooseVariant).
	DatapathVariant string `mapstructure:"datapath-variant"`

	// Lifetimes of idle NAT pairs per connection state (bpf.Lifetimes).
	TimeoutTCPSyn         time.Duration `mapstructure:"nat-timeout-tcp-syn"`
	TimeoutTCPEstablished time.Duration `mapstructure:"nat-timeout-tcp-established"`
	TimeoutTCPClosing     time.Duration `mapstructure:"nat-timeout-tcp-closing"`
	TimeoutTCPReset       time.Duration `mapstructure:"nat-timeout-tcp-reset"`
	TimeoutUDP            time.Duration `mapstructure:"nat-timeout-udp"`
	TimeoutUDPReplied     time.Duration `mapstructure:"nat-timeout-udp-replied"`
	TimeoutICMP           time.Duration `mapstructure:"nat-timeout-icmp"`
	TimeoutOther          time.Duration `mapstructure:"nat-timeout-other"`
}

// Lifetimes are the NAT lifetimes of the flags; an error names the flag
// that is not a positive duration.
func (c Config) Lifetimes() (bpf.Lifetimes, error) {
	for _, f := range []struct {
		name string
		d    time.Duration
	}{
		{"nat-timeout-tcp-syn", c.TimeoutTCPSyn}, {"nat-timeout-tcp-established", c.TimeoutTCPEstablished},
		{"nat-timeout-tcp-closing", c.TimeoutTCPClosing}, {"nat-timeout-tcp-reset", c.TimeoutTCPReset},
		{"nat-timeout-udp", c.TimeoutUDP}, {"nat-timeout-udp-replied", c.TimeoutUDPReplied},
		{"nat-timeout-icmp", c.TimeoutICMP}, {"nat-timeout-other", c.TimeoutOther},
	} {
		if f.d <= 0 {
			return bpf.Lifetimes{}, fmt.Errorf("--%s=%s: want a positive duration, e.g. 30s", f.name, f.d)
		}
	}
	return bpf.Lifetimes{
		TCPSyn: c.TimeoutTCPSyn, TCPEstablished: c.TimeoutTCPEstablished, TCPClosing: c.TimeoutTCPClosing,
		TCPReset: c.TimeoutTCPReset, UDP: c.TimeoutUDP, UDPStream: c.TimeoutUDPReplied, ICMP: c.TimeoutICMP,
		Other: c.TimeoutOther,
	}, nil
}

// DefaultConfig is the configuration used when no flag is given. The port
// range sits above Linux's default ip_local_port_range (32768-60999), so
// masqueraded flows and the node's own connections rarely meet; where they
// do (any range on any ip_local_port_range), the datapath checks the
// node's sockets before it gives a port, and gives a node flow that
// clashes with a pair another port (docs/datapath.md), reserving nothing.
var DefaultConfig = Config{
	NATPortRange:      "61000-65535",
	NATKeepSourcePort: true,
	NATMaxEntries:     0,
	ConntrackMaxPath:  conntrackMaxPath,
	NATGCInterval:     10 * time.Second,
	TCAttachMode:      AttachAuto,
	DatapathVariant:   string(bpf.VariantAuto),

	TimeoutTCPSyn:         bpf.DefaultLifetimes.TCPSyn,
	TimeoutTCPEstablished: bpf.DefaultLifetimes.TCPEstablished,
	TimeoutTCPClosing:     bpf.DefaultLifetimes.TCPClosing,
	TimeoutTCPReset:       bpf.DefaultLifetimes.TCPReset,
	TimeoutUDP:            bpf.DefaultLifetimes.UDP,
	TimeoutUDPReplied:     bpf.DefaultLifetimes.UDPStream,
	TimeoutICMP:           bpf.DefaultLifetimes.ICMP,
	TimeoutOther:          bpf.DefaultLifetimes.Other,
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("nat-port-range", def.NATPortRange,
		"Source ports (and ICMP echo ids) of masqueraded flows whose ports are not kept (see --nat-keep-source-port) and of node flows that clash with a pod's: min-max or p, comma-separated, any number, overlapping or not (their union; port 0 left out), as --to-ports; "+
			"nothing is reserved: a port a node socket uses toward the flow's destination is skipped")
	flags.Bool("nat-keep-source-port", def.NATKeepSourcePort,
		"A TCP or UDP flow keeps its own source port (1024 and up) when no other flow and no node socket holds it toward the same destination, else gets a free one of 1024-65535, as Linux MASQUERADE does; false: every flow gets a port of --nat-port-range (MASQUERADE --to-ports)")
	flags.Bool("nat-random-fully", def.NATRandomFully,
		"A TCP or UDP flow gets a random port (MASQUERADE --random-fully): of 1024-65535 with --nat-keep-source-port, else of --nat-port-range; its own port is never tried first. Set by the Kubernetes agent's --random-fully")
	flags.Uint32("nat-max-entries", def.NATMaxEntries, "Size of each NAT map (IPv4, IPv6); every flow takes two entries; a full map drops a pair that is not assured (unanswered, closing, a UDP query) for a new flow, or refuses it. "+
		"0: two entries per flow the node's conntrack holds, max(Linux's default nf_conntrack_max for the node's memory "+
		"(MemTotal/128 KiB, at least 1024; 65536 above 1 GiB; 262144 above 4 GiB), /proc/sys/net/netfilter/nf_conntrack_max when present); "+
		"and no more than fit the agent's cgroup memory limit beside the Go heap (GOMEMLIMIT, else max(128 MiB, a quarter of the limit)) and 48 MiB for the rest; "+
		"the maps are not preallocated: up to about 128 bytes (IPv4) and 182 bytes (IPv6) of kernel memory per entry with their unmasq records, charged to the agent's cgroup as flows come; a disabled family's map has 1024 entries")
	flags.String("nf-conntrack-max-path", def.ConntrackMaxPath, "File holding the node's conntrack limit that --nat-max-entries=0 sizes the NAT maps from (absent: the node has no conntrack)")
	flags.Duration("nat-gc-interval", def.NATGCInterval, "How often idle NAT entries are expired")
	flags.String("tc-attach-mode", def.TCAttachMode, "How the programs are attached: auto (tcx where the kernel has it, clsact otherwise), tcx or clsact")
	flags.String("datapath-variant", def.DatapathVariant, "Build of the programs loaded: auto (full where the kernel has syscall programs and the atomics, 5.14 on; compat otherwise, 5.10 on), full or compat (for tests: the compat build on a newer kernel)")
	flags.Duration("nat-timeout-tcp-syn", def.TimeoutTCPSyn, "Lifetime of a NAT pair whose TCP SYN is not answered")
	flags.Duration("nat-timeout-tcp-established", def.TimeoutTCPEstablished, "Lifetime of an idle established TCP flow's NAT pair")
	flags.Duration("nat-timeout-tcp-closing", def.TimeoutTCPClosing, "Lifetime of a TCP flow's NAT pair after a FIN (covers the server's TIME_WAIT)")
	flags.Duration("nat-timeout-tcp-reset", def.TimeoutTCPReset, "Lifetime of a TCP flow's NAT pair after a RST")
	flags.Duration("nat-timeout-udp", def.TimeoutUDP, "Lifetime of an idle UDP flow's NAT pair before the remote answers, and of a query and its answer")
	flags.Duration("nat-timeout-udp-replied", def.TimeoutUDPReplied, "Lifetime of an idle UDP stream's NAT pair: answered, and still active 2 s after it started")
	flags.Duration("nat-timeout-icmp", def.TimeoutICMP, "Lifetime of an idle ICMP echo flow's NAT pair")
	flags.Duration("nat-timeout-other", def.TimeoutOther, "Lifetime of an idle SCTP or address-only (GRE, ESP, ...) NAT pair")
}

// PortRange is an inclusive port range.
type PortRange struct{ Min, Max uint16 }

func (r PortRange) String() string { return fmt.Sprintf("%d-%d", r.Min, r.Max) }

// Overlaps reports whether two ranges share a port.
func (r PortRange) Overlaps(o PortRange) bool { return r.Min <= o.Max && o.Min <= r.Max }

// ParsePortRange parses "min-max" (1 <= min <= max <= 65535).
func ParsePortRange(flag, s string) (PortRange, error) {
	lo, hi, ok := strings.Cut(strings.TrimSpace(s), "-")
	min, err1 := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
	max, err2 := strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
	if !ok || err1 != nil || err2 != nil || min == 0 || max < min {
		return PortRange{}, fmt.Errorf("%s=%q: want min-max with 1 <= min <= max <= 65535, e.g. 61000-65535", flag, s)
	}
	return PortRange{uint16(min), uint16(max)}, nil
}

// PortRanges are NAT port ranges: from ParsePortRanges, a sorted union
// (no two overlap or touch).
type PortRanges []PortRange

// String gives the ranges as --nat-port-range takes them ("p" for a range
// of one port, as upstream's --to-ports writes it).
func (rs PortRanges) String() string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		if r.Min == r.Max {
			parts[i] = strconv.Itoa(int(r.Min))
		} else {
			parts[i] = r.String()
		}
	}
	return strings.Join(parts, ",")
}

// Pairs returns the ranges as bpf.Datapath.SetPortRanges takes them.
func (rs PortRanges) Pairs() [][2]uint16 {
	out := make([][2]uint16, len(rs))
	for i, r := range rs {
		out[i] = [2]uint16{r.Min, r.Max}
	}
	return out
}

// Size is the number of ports of the ranges.
func (rs PortRanges) Size() int {
	n := 0
	for _, r := range rs {
		n += int(r.Max) - int(r.Min) + 1
	}
	return n
}

// ParsePortRanges parses what the Kubernetes agent's --to-ports takes
// (its interval.ParseIntervals, then iptables' MASQUERADE --to-ports):
// comma-separated ranges "min-max" or single ports "p", 0 <= min <= max <=
// 65535, any number of them, in any order, overlapping or not. The result
// is their sorted union. Port 0 is left out (a flow is never given it:
// Linux would, and many stacks and middleboxes drop port 0); a value of
// port 0 alone is refused. The warnings say what is odd: port 0 left out,
// ports below 1024 (privileged on the remote's side), ranges that
// overlap.
func ParsePortRanges(flag, s string) (PortRanges, []string, error) {
	var (
		in       []PortRange
		given    []string // in's parts as written
		warnings []string
		zero     bool
	)
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		lo, hi, isRange := strings.Cut(part, "-")
		if !isRange {
			hi = lo
		}
		min, err1 := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
		max, err2 := strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
		if err1 != nil || err2 != nil || max < min {
			return nil, nil, fmt.Errorf("%s=%q: range %q: want min-max (or one port p), 0 <= min <= max <= 65535, comma-separated, e.g. 1024-29999,32768-65535", flag, s, part)
		}
		if min == 0 {
			zero = true
			if max == 0 {
				continue
			}
			min = 1
		}
		for i, o := range in {
			if o.Overlaps(PortRange{uint16(min), uint16(max)}) {
				warnings = append(warnings, fmt.Sprintf("%s=%s: ranges %s and %s overlap: their union is used", flag, s, given[i], part))
			}
		}
		in = append(in, PortRange{uint16(min), uint16(max)})
		given = append(given, part)
	}
	if len(in) == 0 {
		return nil, nil, fmt.Errorf("%s=%q: no port but 0, which no flow is given: want ports from 1, e.g. 61000-65535", flag, s)
	}
	if zero {
		warnings = append(warnings, fmt.Sprintf("%s=%s: port 0 is left out: no flow is given source port 0", flag, s))
	}
	sort.Slice(in, func(i, j int) bool { return in[i].Min < in[j].Min })
	out := PortRanges{in[0]}
	for _, r := range in[1:] {
		last := &out[len(out)-1]
		if uint32(r.Min) <= uint32(last.Max)+1 {
			last.Max = max(last.Max, r.Max)
			continue
		}
		out = append(out, r)
	}
	if out[0].Min < 1024 {
		warnings = append(warnings, fmt.Sprintf("%s=%s: ports below 1024 are privileged ports to remote services, which may treat a connection from one as trusted (rsh, NFS's secure ports)", flag, s))
	}
	return out, warnings, nil
}
