package main

import (
	"io"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/reconcilers/datapath"
)

// parseUpstream parses args into a flag set holding the datapath's flags
// and the upstream ones, and applies the upstream ones.
func parseUpstream(t *testing.T, args ...string) (*pflag.FlagSet, []string, error) {
	t.Helper()
	var u upstreamFlags
	flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	datapath.DefaultConfig.Flags(flags)
	u.register(flags)
	if err := flags.Parse(args); err != nil {
		t.Fatal(err)
	}
	warnings, err := u.apply(flags)
	return flags, warnings, err
}

func TestToPortsSetsTheNATPortRange(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		warn     int
	}{
		{"32768-65535", "32768-65535", 0}, {"40000", "40000", 0}, {" 1024-2048 ", "1024-2048", 0},
		// upstream's help example: several ranges, a MASQUERADE rule each
		{"1024-29999,32768-65535", "1024-29999,32768-65535", 0},
		// what upstream's interval.ParseIntervals and iptables take: the
		// union, port 0 left out, the odd ones said (the ports below
		// 1024 are the datapath's warning, at its start)
		{"80,1024-2048", "80,1024-2048", 0},
		{"1024-2000,1500-3000", "1024-3000", 1},
		{"1,2,3,4,5,6,7,8,9,20000", "1-9,20000", 0},
		{"0-100", "1-100", 1},
	} {
		flags, warnings, err := parseUpstream(t, "--to-ports="+tc.in)
		if err != nil || len(warnings) != tc.warn {
			t.Fatalf("--to-ports=%s: %q %v, want %d warnings", tc.in, warnings, err, tc.warn)
		}
		if got := flags.Lookup("nat-port-range").Value.String(); got != tc.want {
			t.Errorf("--to-ports=%s: --nat-port-range=%s, want %s", tc.in, got, tc.want)
		}
		if got := flags.Lookup("nat-keep-source-port").Value.String(); got != "false" {
			t.Errorf("--to-ports=%s: --nat-keep-source-port=%s, want false (every port from the range)", tc.in, got)
		}
	}
	flags, _, err := parseUpstream(t)
	if err != nil || flags.Lookup("nat-port-range").Value.String() != datapath.DefaultConfig.NATPortRange ||
		flags.Lookup("nat-keep-source-port").Value.String() != "true" || flags.Lookup("nat-random-fully").Value.String() != "false" {
		t.Errorf("without --to-ports the NAT flags changed: %v", err)
	}
}

// TestRandomFullySetsNATRandomFully: upstream's --random-fully, when given,
// is --nat-random-fully; not given, ipmasq's default (ports kept) stays.
func TestRandomFullySetsNATRandomFully(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "false"},
		{[]string{"--random-fully"}, "true"},
		{[]string{"--random-fully=true"}, "true"},
		{[]string{"--random-fully=false"}, "false"},
		{[]string{"--random-fully", "--to-ports=40000-40100"}, "true"},
	} {
		flags, warnings, err := parseUpstream(t, tc.args...)
		if err != nil || len(warnings) != 0 {
			t.Fatalf("%q: %q %v", tc.args, warnings, err)
		}
		if got := flags.Lookup("nat-random-fully").Value.String(); got != tc.want {
			t.Errorf("%q: --nat-random-fully=%s, want %s", tc.args, got, tc.want)
		}
	}
	if _, _, err := parseUpstream(t, "--random-fully", "--nat-random-fully=false"); err == nil ||
		!strings.Contains(err.Error(), "--random-fully and --nat-random-fully are both given") {
		t.Errorf("both flags: %v", err)
	}
}

func TestToPortsRefusals(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--to-ports=1024-29999,x"}, `range "x": want min-max`},
		{[]string{"--to-ports=0"}, `--to-ports="0": no port but 0`},
		{[]string{"--to-ports=10-5"}, `--to-ports="10-5": range "10-5"`},
		{[]string{"--to-ports=1-2-3"}, `--to-ports="1-2-3": range "1-2-3"`},
		{[]string{"--to-ports=1-65536"}, `range "1-65536"`},
		{[]string{"--to-ports=5000", "--nat-port-range=1-2"}, "--to-ports and --nat-port-range are both given"},
		{[]string{"--to-ports=5000", "--nat-keep-source-port=true"}, "--to-ports and --nat-keep-source-port are both given"},
	} {
		flags, _, err := parseUpstream(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: error %v, want %q", tc.args, err, tc.want)
		}
		if got := flags.Lookup("nat-port-range").Value.String(); !flags.Changed("nat-port-range") && got != datapath.DefaultConfig.NATPortRange {
			t.Errorf("%v: a refused --to-ports changed --nat-port-range to %s", tc.args, got)
		}
	}
}

// TestUpstreamArgsWarnOncePerFlag: the flags an upstream DaemonSet passes
// (GKE's, for one: --masq-chain, --nomasq-all-reserved-ranges is ipmasq's
// own, klog's --v and --logtostderr) are accepted, one warning each, and
// the ones not given warn nothing.
func TestUpstreamArgsWarnOncePerFlag(t *testing.T) {
	_, warnings, err := parseUpstream(t, "--masq-chain=IP-MASQ", "--random-fully=false", "--v=2", "--logtostderr", "--log_dir=/var/log")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"--masq-chain=IP-MASQ ", "--v=2 ", "--logtostderr=true ", "--log_dir=/var/log "}
	if len(warnings) != len(want) {
		t.Fatalf("warnings %q, want one for each of %q", warnings, want)
	}
	for i, w := range want {
		if !strings.HasPrefix(warnings[i], w) || !strings.Contains(warnings[i], "has no effect") {
			t.Errorf("warning %d = %q, want it to start with %q and say it has no effect", i, warnings[i], w)
		}
	}
}

// TestGoStyleArgs: upstream's single-dash spellings reach the same flags.
func TestGoStyleArgs(t *testing.T) {
	root := newRootCommand()
	got := goStyleArgs(root.Flags(), []string{"-v=2", "-masq-chain=IP-MASQ", "-nomasq-all-reserved-ranges", "-logtostderr",
		"--log-level=debug", "-h", "-x", "status", "--", "-v=3"})
	want := []string{"--v=2", "--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges", "--logtostderr",
		"--log-level=debug", "-h", "-x", "status", "--", "-v=3"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("got  %q\nwant %q", got, want)
	}
}

// TestToPortsEmptyIsUnset: --to-ports= is upstream's default (its agent
// adds no port range for an empty value): accepted, nothing changed, even
// beside --nat-port-range.
func TestToPortsEmptyIsUnset(t *testing.T) {
	for _, args := range [][]string{{"--to-ports="}, {"--to-ports", " "}, {"--to-ports=", "--nat-port-range=40000-50000"}} {
		flags, warnings, err := parseUpstream(t, args...)
		if err != nil || len(warnings) != 0 {
			t.Errorf("%q: warnings %q, error %v; want it taken as no --to-ports", args, warnings, err)
			continue
		}
		want := datapath.DefaultConfig.NATPortRange
		if flags.Changed("nat-port-range") {
			want = "40000-50000"
		}
		if got := flags.Lookup("nat-port-range").Value.String(); got != want {
			t.Errorf("%q: --nat-port-range=%s, want %s", args, got, want)
		}
		if got := flags.Lookup("nat-keep-source-port").Value.String(); got != "true" {
			t.Errorf("%q: --nat-keep-source-port=%s, want true", args, got)
		}
	}
}

// TestKlogValuesAsUpstream: klog's flags take what klog's parsers take
// and refuse what makes the upstream binary exit at its flags (checked
// against the built upstream binary at the pinned commit).
func TestKlogValuesAsUpstream(t *testing.T) {
	for _, tc := range []struct {
		arg string
		ok  bool
	}{
		{"--stderrthreshold=WARNING", true}, {"--stderrthreshold=warning", true}, {"--stderrthreshold=7", true},
		{"--stderrthreshold=-1", true}, {"--stderrthreshold=bogus", false}, {"--stderrthreshold=", false},
		{"--alsologtostderrthreshold=ERROR", true}, {"--alsologtostderrthreshold=bogus", false},
		{"--vmodule=main=4", true}, {"--vmodule=main=4,foo*=2,", true}, {"--vmodule=", true}, {"--vmodule=main=0", true},
		{"--vmodule=main", false}, {"--vmodule=main=x", false}, {"--vmodule=main=-1", false}, {"--vmodule==2", false},
		{"--vmodule=a=b=2", false},
		{"--log_backtrace_at=main.go:10", true}, {"--log_backtrace_at=", true},
		{"--log_backtrace_at=x", false}, {"--log_backtrace_at=main.go:x", false}, {"--log_backtrace_at=main:10", false},
		{"--log_backtrace_at=main.go:0", false}, {"--log_backtrace_at=a.go:1:2", false},
		{"--v=2", true}, {"--v=-1", true}, {"--v=2147483648", false}, {"--v=x", false},
	} {
		var u upstreamFlags
		flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
		flags.SetOutput(io.Discard)
		datapath.DefaultConfig.Flags(flags)
		u.register(flags)
		err := flags.Parse([]string{tc.arg})
		if (err == nil) != tc.ok {
			t.Errorf("%s: error %v, want accepted %v (as upstream)", tc.arg, err, tc.ok)
		}
	}
}

// A boolean flag followed by its value as the next argument is refused
// with the spelling that works; flags with values, and booleans with '=',
// pass.
func TestBoolValueAsArgument(t *testing.T) {
	flags := newRootCommand().Flags()
	for _, tc := range []struct {
		args []string
		want string // "" for no error
	}{
		{[]string{"-logtostderr", "false", "--masq-chain=X"}, `-logtostderr false: a boolean flag takes its value after '=' (-logtostderr=false)`},
		{[]string{"--v=2", "--enable-ipv6", "1"}, `--enable-ipv6 1: a boolean flag takes its value after '=' (--enable-ipv6=1)`},
		{[]string{"-logtostderr=false", "-v", "2", "--masq-chain", "true"}, ""},
		{[]string{"--enable-ipv6", "--random-fully"}, ""},
		{[]string{"--", "--enable-ipv6", "false"}, ""},
	} {
		err := boolValueAsArgument(flags, tc.args)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%q: %v, want no error", tc.args, err)
		case tc.want != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.want)):
			t.Errorf("%q: %v, want an error starting %q", tc.args, err, tc.want)
		}
	}
}
