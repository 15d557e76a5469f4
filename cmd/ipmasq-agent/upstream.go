package main

import (
	"fmt"
	"strings"

	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/reconcilers/datapath"
)

// upstreamFlags are the flags of the Kubernetes ip-masq-agent
// (kubernetes-sigs/ip-masq-agent) that ipmasq has no flag of the same name
// for, so that its DaemonSet's args start this agent unchanged.
// --nomasq-all-reserved-ranges and --enable-ipv6 are ipmasq's own flags
// (cells/config, settings) with upstream's meaning and default.
type upstreamFlags struct {
	// toPorts is --to-ports: upstream's MASQUERADE port ranges, mapped onto
	// --nat-port-range.
	toPorts string
}

// ignoredUpstreamFlag is an upstream flag that means nothing to an eBPF
// agent: accepted, with one warning line when given.
type ignoredUpstreamFlag struct {
	name string
	// kind is the flag's type upstream, so that a value upstream would
	// refuse is refused here too: "bool", "int", "uint64" or "string".
	kind string
	def  string
	why  string
}

const klogWhy = "ipmasq logs with log/slog to stderr; use --log-level (debug, info, warn, error)"

// ignoredUpstreamFlags: upstream's own, then the klog flags
// (klog.InitFlags) its binary registers. testdata/upstream-flags.txt lists
// every flag of the upstream binary at the version the tests pin
// (TestEveryUpstreamFlagStarts), read from its source.
var ignoredUpstreamFlags = []ignoredUpstreamFlag{
	{"masq-chain", "string", "IP-MASQ-AGENT", "ipmasq writes no iptables chain: the decision is made by its tc programs"},
	{"random-fully", "bool", "true", "ipmasq picks NAT ports itself: a flow keeps its source port when free (--nat-keep-source-port), else gets one of --nat-port-range"},
	{"v", "int", "0", klogWhy},
	{"vmodule", "string", "", klogWhy},
	{"logtostderr", "bool", "true", klogWhy},
	{"alsologtostderr", "bool", "false", klogWhy},
	{"alsologtostderrthreshold", "string", "0", klogWhy},
	{"legacy_stderr_threshold_behavior", "bool", "true", klogWhy},
	{"stderrthreshold", "string", "2", klogWhy},
	{"log_dir", "string", "", klogWhy},
	{"log_file", "string", "", klogWhy},
	{"log_file_max_size", "uint64", "1800", klogWhy},
	{"log_backtrace_at", "string", "", klogWhy},
	{"skip_headers", "bool", "false", klogWhy},
	{"skip_log_headers", "bool", "false", klogWhy},
	{"add_dir_header", "bool", "false", klogWhy},
	{"one_output", "bool", "false", klogWhy},
}

func (u *upstreamFlags) register(flags *pflag.FlagSet) {
	flags.StringVar(&u.toPorts, "to-ports", "",
		"Kubernetes ip-masq-agent compatibility: masquerade TCP, UDP and SCTP to ports of these ranges only (e.g. 1024-29999,32768-65535: a flow draws a range by its share of the ports, as upstream's rule per range does); sets --nat-port-range and --nat-keep-source-port=false")
	for _, f := range ignoredUpstreamFlags {
		usage := "Kubernetes ip-masq-agent compatibility, no effect: " + f.why
		switch f.kind {
		case "bool":
			flags.Bool(f.name, f.def == "true", usage)
		case "int":
			flags.Int(f.name, 0, usage)
		case "uint64":
			flags.Uint64(f.name, 1800, usage)
		default:
			flags.String(f.name, f.def, usage)
		}
	}
}

// apply maps --to-ports onto the datapath's flags and returns one warning
// per ignored upstream flag that was given. It changes nothing when it
// returns an error.
func (u *upstreamFlags) apply(flags *pflag.FlagSet) (warnings []string, err error) {
	if flags.Changed("to-ports") {
		r, err := parseToPorts(u.toPorts)
		if err != nil {
			return nil, err
		}
		for _, other := range []string{"nat-port-range", "nat-keep-source-port"} {
			if flags.Changed(other) {
				return nil, fmt.Errorf("--to-ports and --%s are both given: --to-ports sets --nat-port-range=%s and --nat-keep-source-port=false; give one or the other", other, r)
			}
		}
		if err := flags.Set("nat-port-range", r.String()); err != nil {
			return nil, err
		}
		if err := flags.Set("nat-keep-source-port", "false"); err != nil {
			return nil, err
		}
	}
	for _, f := range ignoredUpstreamFlags {
		if flags.Changed(f.name) {
			warnings = append(warnings, fmt.Sprintf("--%s=%s has no effect: %s", f.name, flags.Lookup(f.name).Value, f.why))
		}
	}
	return warnings, nil
}

// parseToPorts reads upstream's --to-ports syntax ("a-b" or "a", ranges
// separated by commas, as its help's example 1024-29999,32768-65535):
// several ranges are searched as upstream's MASQUERADE rule per range
// searches them (datapath.ParsePortRanges, bpf/lib/ports.h).
func parseToPorts(s string) (datapath.PortRanges, error) {
	if strings.Contains(s, ",") {
		return datapath.ParsePortRanges("--to-ports", s)
	}
	r := strings.TrimSpace(s)
	if !strings.Contains(r, "-") {
		r = r + "-" + r
	}
	pr, err := datapath.ParsePortRange("--to-ports", r)
	if err != nil {
		return nil, fmt.Errorf("--to-ports=%q: want ranges min-max (or one port), 1 <= min <= max <= 65535, separated by commas, e.g. 1024-29999,32768-65535", s)
	}
	return datapath.PortRanges{pr}, nil
}

// goStyleArgs rewrites "-name" and "-name=value" to "--name..." when name is
// one of flags' long names: upstream parses its flags with Go's flag
// package, which takes a single dash too (-v=2, -masq-chain=X), and its
// users' manifests may hold either. Shorthands ("-h") and everything else
// are left as they are; "--" ends the rewriting.
func goStyleArgs(flags *pflag.FlagSet, args []string) []string {
	out := make([]string, 0, len(args))
	for i, a := range args {
		if a == "--" {
			return append(out, args[i:]...)
		}
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "-"), "=")
		if len(a) > 1 && a[0] == '-' && a[1] != '-' && flags.Lookup(name) != nil && (len(name) > 1 || flags.ShorthandLookup(name) == nil) {
			a = "-" + a
		}
		out = append(out, a)
	}
	return out
}
