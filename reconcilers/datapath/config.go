package datapath

import (
	"fmt"
	"os"
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
// masqueraded flows and the node's own connections never compete for a port.
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
		"Source ports (and ICMP echo ids) of masqueraded flows whose ports are not kept (see --nat-keep-source-port) and of node flows that clash with a pod's, min-max; reserved from the node's own connections if ip_local_port_range overlaps. "+
			"Several ranges, min-max,min-max (at most 8): a flow draws one by its share of the ports and searches it alone, as the Kubernetes agent's MASQUERADE rule per --to-ports range does")
	flags.Bool("nat-keep-source-port", def.NATKeepSourcePort,
		"A TCP or UDP flow keeps its own source port (1024 and up) when no other flow and no node socket holds it toward the same destination, else gets a free one of 1024-65535, as Linux MASQUERADE does; false: every flow gets a port of --nat-port-range (MASQUERADE --to-ports)")
	flags.Uint32("nat-max-entries", def.NATMaxEntries, "Size of each NAT map (IPv4, IPv6); every flow takes two entries; a full map drops a pair that is not assured (unanswered, closing, a UDP query) for a new flow, or refuses it. "+
		"0: two entries per flow the node's conntrack holds, max(Linux's default nf_conntrack_max for the node's memory "+
		"(MemTotal/128 KiB, at least 1024; 65536 above 1 GiB; 262144 above 4 GiB), /proc/sys/net/netfilter/nf_conntrack_max when present); "+
		"and no more than fit the agent's cgroup memory limit beside the Go heap (GOMEMLIMIT, else max(128 MiB, a quarter of the limit)) and 48 MiB for the rest; "+
		"the maps are not preallocated: up to about 128 bytes (IPv4) and 182 bytes (IPv6) of kernel memory per entry with their unmasq records, charged to the agent's cgroup as flows come; a disabled family's map has 1024 entries")
	flags.String("nf-conntrack-max-path", def.ConntrackMaxPath, "File holding the node's conntrack limit that --nat-max-entries=0 sizes the NAT maps from (absent: the node has no conntrack)")
	flags.Duration("nat-gc-interval", def.NATGCInterval, "How often idle NAT entries are expired")
	flags.String("tc-attach-mode", def.TCAttachMode, "How the programs are attached: auto (tcx where the kernel has it, clsact otherwise), tcx or clsact")
	flags.String("datapath-variant", def.DatapathVariant, "Build of the programs loaded: auto (full where the kernel has bpf_loop, syscall programs and the atomics, 5.17 on; compat otherwise, 5.10 on), full or compat (for tests: the compat build on a newer kernel)")
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

// PortRanges are NAT port ranges that do not overlap, in the order given.
type PortRanges []PortRange

func (rs PortRanges) String() string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = r.String()
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

// ParsePortRanges parses "min-max" or several ranges "a-b,c-d" (a single
// port "p" is p-p in a list, as iptables and the Kubernetes agent take it),
// at most bpf.NATPortRangesMax, none overlapping another.
func ParsePortRanges(flag, s string) (PortRanges, error) {
	if !strings.Contains(s, ",") {
		r, err := ParsePortRange(flag, s)
		if err != nil {
			return nil, err
		}
		return PortRanges{r}, nil
	}
	parts := strings.Split(s, ",")
	if len(parts) > bpf.NATPortRangesMax {
		return nil, fmt.Errorf("%s=%q: %d ranges, at most %d are supported", flag, s, len(parts), bpf.NATPortRangesMax)
	}
	var out PortRanges
	for _, part := range parts {
		part = strings.TrimSpace(part)
		if part != "" && !strings.Contains(part, "-") {
			part += "-" + part
		}
		r, err := ParsePortRange(flag, part)
		if err != nil {
			return nil, fmt.Errorf("%s=%q: range %q: want min-max with 1 <= min <= max <= 65535, e.g. 1024-29999,32768-65535", flag, s, strings.TrimSpace(part))
		}
		for _, o := range out {
			if r.Overlaps(o) {
				return nil, fmt.Errorf("%s=%q: ranges %s and %s overlap", flag, s, o, r)
			}
		}
		out = append(out, r)
	}
	return out, nil
}

const (
	localPortRangePath     = "/proc/sys/net/ipv4/ip_local_port_range"
	localReservedPortsPath = "/proc/sys/net/ipv4/ip_local_reserved_ports"
)

// reserveNATPorts makes sure the node's own connections never take a NAT
// port: when ip_local_port_range overlaps the NAT range, the NAT range is
// added to ip_local_reserved_ports (keeping what is already reserved). It
// returns what it did, for the log.
func reserveNATPorts(nat PortRange) (string, error) {
	data, err := os.ReadFile(localPortRangePath)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", localPortRangePath, err)
	}
	// The kernel writes "32768\t60999".
	local, err := ParsePortRange(localPortRangePath, strings.Join(strings.Fields(string(data)), "-"))
	if err != nil {
		return "", err
	}
	if !nat.Overlaps(local) {
		return "", nil
	}
	reserved, err := os.ReadFile(localReservedPortsPath)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", localReservedPortsPath, err)
	}
	cur := strings.TrimSpace(string(reserved))
	if containsRange(cur, nat) {
		return "", nil
	}
	next := nat.String()
	if cur != "" {
		next = cur + "," + next
	}
	if err := os.WriteFile(localReservedPortsPath, []byte(next), 0o644); err != nil {
		return "", fmt.Errorf("--nat-port-range=%s overlaps ip_local_port_range %s and reserving it in %s failed: %w "+
			"(pick a --nat-port-range outside %s)", nat, local, localReservedPortsPath, err, local)
	}
	return fmt.Sprintf("--nat-port-range=%s overlaps ip_local_port_range %s: reserved it in %s", nat, local, localReservedPortsPath), nil
}

// containsRange reports whether a reserved-ports list ("1,5-9") already
// covers r.
func containsRange(list string, r PortRange) bool {
	for _, part := range strings.Split(list, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		if !strings.Contains(part, "-") {
			part += "-" + part
		}
		if pr, err := ParsePortRange("", part); err == nil && pr.Min <= r.Min && r.Max <= pr.Max {
			return true
		}
	}
	return false
}
