package main

import (
	"errors"
	"fmt"
	"strconv"
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
	// randomFully is --random-fully: upstream's MASQUERADE --random-fully,
	// mapped onto --nat-random-fully when given.
	randomFully bool
}

// ignoredUpstreamFlag is an upstream flag that means nothing to an eBPF
// agent: accepted, with one warning line when given.
type ignoredUpstreamFlag struct {
	name string
	// kind is the flag's type upstream, so that a value upstream would
	// refuse is refused here too: "bool", "int32", "uint64", "string", or
	// one of klog's own values ("severity", "vmodule", "traceLocation",
	// checked as klog's Set checks them: upstreamValueCheck).
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
	{"v", "int32", "0", klogWhy},
	{"vmodule", "vmodule", "", klogWhy},
	{"logtostderr", "bool", "true", klogWhy},
	{"alsologtostderr", "bool", "false", klogWhy},
	{"alsologtostderrthreshold", "severity", "0", klogWhy},
	{"legacy_stderr_threshold_behavior", "bool", "true", klogWhy},
	{"stderrthreshold", "severity", "2", klogWhy},
	{"log_dir", "string", "", klogWhy},
	{"log_file", "string", "", klogWhy},
	{"log_file_max_size", "uint64", "1800", klogWhy},
	{"log_backtrace_at", "traceLocation", "", klogWhy},
	{"skip_headers", "bool", "false", klogWhy},
	{"skip_log_headers", "bool", "false", klogWhy},
	{"add_dir_header", "bool", "false", klogWhy},
	{"one_output", "bool", "false", klogWhy},
}

func (u *upstreamFlags) register(flags *pflag.FlagSet) {
	flags.StringVar(&u.toPorts, "to-ports", "",
		"Kubernetes ip-masq-agent compatibility: masquerade TCP, UDP and SCTP to ports of these ranges only (e.g. 1024-29999,32768-65535, any number, overlapping or not: their union); sets --nat-port-range and --nat-keep-source-port=false")
	flags.BoolVar(&u.randomFully, "random-fully", true,
		"Kubernetes ip-masq-agent compatibility: when given, sets --nat-random-fully (every TCP and UDP flow gets a random port of its space, as MASQUERADE --random-fully); not given, ipmasq keeps a flow's own port when free (--nat-random-fully=false, Linux MASQUERADE's default: see docs/migrate.md)")
	for _, f := range ignoredUpstreamFlags {
		usage := "Kubernetes ip-masq-agent compatibility, no effect: " + f.why
		switch f.kind {
		case "bool":
			flags.Bool(f.name, f.def == "true", usage)
		case "int32":
			flags.Int32(f.name, 0, usage)
		case "uint64":
			flags.Uint64(f.name, 1800, usage)
		case "string":
			flags.String(f.name, f.def, usage)
		default:
			flags.Var(&checkedValue{value: f.def, kind: f.kind, check: upstreamValueCheck[f.kind]}, f.name, usage)
		}
	}
}

// checkedValue is a string flag that refuses what its check refuses: the
// klog values upstream parses (a threshold, a vmodule list, a trace
// location), so that ipmasq refuses what would make upstream exit.
type checkedValue struct {
	value, kind string
	check       func(string) error
}

func (v *checkedValue) String() string { return v.value }
func (v *checkedValue) Type() string   { return v.kind }
func (v *checkedValue) Set(s string) error {
	if err := v.check(s); err != nil {
		return err
	}
	v.value = s
	return nil
}

// upstreamValueCheck checks a value of each of klog's own flag types as
// klog v2 (the version upstream's go.mod requires) parses it.
var upstreamValueCheck = map[string]func(string) error{
	// A severity by name (any case) or a number (klog's severityValue).
	"severity": func(s string) error {
		switch strings.ToUpper(s) {
		case "INFO", "WARNING", "ERROR", "FATAL":
			return nil
		}
		if _, err := strconv.ParseInt(s, 10, 32); err != nil {
			return errors.New("want INFO, WARNING, ERROR, FATAL or a number")
		}
		return nil
	},
	// pattern=N, comma-separated, N >= 0 (klog's moduleSpec; empty
	// items, as from a trailing comma, are skipped).
	"vmodule": func(s string) error {
		for _, item := range strings.Split(s, ",") {
			if item == "" {
				continue
			}
			pattern, level, ok := strings.Cut(item, "=")
			n, err := strconv.ParseInt(level, 10, 32)
			if !ok || pattern == "" || strings.Contains(level, "=") || err != nil || n < 0 {
				return fmt.Errorf("%q: want a comma-separated list of pattern=N, N >= 0", item)
			}
		}
		return nil
	},
	// file.go:N with N > 0, or empty (klog's traceLocation).
	"traceLocation": func(s string) error {
		if s == "" {
			return nil
		}
		file, line, ok := strings.Cut(s, ":")
		n, err := strconv.Atoi(line)
		if !ok || strings.Contains(line, ":") || !strings.Contains(file, ".") || err != nil || n <= 0 {
			return errors.New("want file.go:N with N > 0")
		}
		return nil
	},
}

// apply maps --to-ports onto the datapath's flags and returns one warning
// per ignored upstream flag that was given. It changes nothing when it
// returns an error.
func (u *upstreamFlags) apply(flags *pflag.FlagSet) (warnings []string, err error) {
	// An empty --to-ports is upstream's default, not a range: its agent
	// masquerades as without the flag (a manifest's templated
	// --to-ports=$(TO_PORTS) with nothing to fill in).
	if flags.Changed("to-ports") && strings.TrimSpace(u.toPorts) != "" {
		r, toWarnings, err := datapath.ParsePortRanges("--to-ports", u.toPorts)
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
		// The union loses what was odd in the value (port 0, overlaps):
		// said here; the low ports the datapath warns of itself.
		for _, w := range toWarnings {
			if !strings.Contains(w, "below 1024") {
				warnings = append(warnings, w)
			}
		}
	}
	if flags.Changed("random-fully") {
		if flags.Changed("nat-random-fully") {
			return nil, fmt.Errorf("--random-fully and --nat-random-fully are both given: --random-fully sets --nat-random-fully; give one or the other")
		}
		if err := flags.Set("nat-random-fully", strconv.FormatBool(u.randomFully)); err != nil {
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

// boolValueAsArgument finds a boolean flag given its value as the next
// argument ("-logtostderr false"). Go's flag package and pflag both take
// "false" there as the first argument that is not a flag: upstream's agent
// then stops reading flags and ignores every one after it, and cobra would
// report an unknown command "false". The error names the flag and the
// spelling that works, as the user wrote it (one dash or two).
func boolValueAsArgument(flags *pflag.FlagSet, args []string) error {
	for i := 1; i < len(args); i++ {
		prev, a := args[i-1], args[i]
		if prev == "--" {
			return nil
		}
		if !strings.HasPrefix(prev, "-") || strings.Contains(prev, "=") {
			continue
		}
		f := flags.Lookup(strings.TrimLeft(prev, "-"))
		if f == nil || f.NoOptDefVal == "" {
			continue
		}
		if _, err := strconv.ParseBool(a); err == nil {
			return fmt.Errorf("%s %s: a boolean flag takes its value after '=' (%s=%s); %q was read as an argument, and upstream's agent would ignore every flag after it",
				prev, a, prev, a, a)
		}
	}
	return nil
}
