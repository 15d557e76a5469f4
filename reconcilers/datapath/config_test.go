package datapath

import (
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
)

func TestPortRanges(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want PortRange
		err  bool
	}{
		{"61000-65535", PortRange{61000, 65535}, false},
		{" 1024-2048 ", PortRange{1024, 2048}, false},
		{"5-5", PortRange{5, 5}, false},
		{"0-10", PortRange{}, true},
		{"10-5", PortRange{}, true},
		{"61000", PortRange{}, true},
		{"a-b", PortRange{}, true},
		{"1-65536", PortRange{}, true},
	} {
		got, err := ParsePortRange("--nat-port-range", tc.in)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("ParsePortRange(%q) = %v, %v", tc.in, got, err)
		}
	}
	if !(PortRange{32768, 60999}).Overlaps(PortRange{60000, 61000}) || (PortRange{32768, 60999}).Overlaps(PortRange{61000, 65535}) {
		t.Error("Overlaps")
	}
}

func TestLifetimeFlags(t *testing.T) {
	l, err := DefaultConfig.Lifetimes()
	if err != nil || l != bpf.DefaultLifetimes {
		t.Fatalf("defaults: %+v %v", l, err)
	}
	c := DefaultConfig
	c.TimeoutUDPReplied = 0
	if _, err := c.Lifetimes(); err == nil || err.Error() != "--nat-timeout-udp-replied=0s: want a positive duration, e.g. 30s" {
		t.Fatalf("zero lifetime: %v", err)
	}
	c = DefaultConfig
	c.TimeoutOther = -time.Second
	if _, err := c.Lifetimes(); err == nil || !strings.Contains(err.Error(), "--nat-timeout-other=-1s") {
		t.Fatalf("negative lifetime: %v", err)
	}
}

// TestParsePortRanges: --nat-port-range and --to-ports take every value
// the Kubernetes agent's --to-ports takes (its interval.ParseIntervals,
// then iptables' MASQUERADE): any number of ranges or single ports, in any
// order, overlapping or not, from 0; the result is their sorted union
// without port 0, and the warnings say what was odd.
func TestParsePortRanges(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		warn     []string // substrings, one per warning, in order
	}{
		{"61000-65535", "61000-65535", nil},
		{"61000", "61000", nil},
		{"1024-29999,32768-65535", "1024-29999,32768-65535", nil},
		{"32768-65535,1024-29999", "1024-29999,32768-65535", nil},
		{" 80 , 1024-2048", "80,1024-2048", []string{"below 1024"}},
		{"1024-2000,1500-3000", "1024-3000", []string{"ranges 1024-2000 and 1500-3000 overlap"}},
		{"1024-2000,2001-3000", "1024-3000", nil},
		{"1,3,5,7,9,11,13,15,17,19", "1,3,5,7,9,11,13,15,17,19", []string{"below 1024"}},
		{"3000,2000-2999,3000-3000", "2000-3000", []string{"ranges 3000 and 3000-3000 overlap"}},
		{"0-100", "1-100", []string{"port 0 is left out", "below 1024"}},
		{"0,40000-40010", "40000-40010", []string{"port 0 is left out"}},
		{"1-65535", "1-65535", []string{"below 1024"}},
	} {
		got, warnings, err := ParsePortRanges("--nat-port-range", tc.in)
		if err != nil || got.String() != tc.want {
			t.Errorf("ParsePortRanges(%q) = %v, %v; want %s", tc.in, got, err, tc.want)
			continue
		}
		if len(warnings) != len(tc.warn) {
			t.Errorf("ParsePortRanges(%q) warnings %q, want %d: %q", tc.in, warnings, len(tc.warn), tc.warn)
			continue
		}
		for i, w := range tc.warn {
			if !strings.Contains(warnings[i], w) || !strings.Contains(warnings[i], "--nat-port-range=") {
				t.Errorf("ParsePortRanges(%q) warning %q, want %q", tc.in, warnings[i], w)
			}
		}
	}
	for in, want := range map[string]string{
		"1024-2048,":                  `range "": want min-max`,
		"0":                           "no port but 0",
		"0-0,0":                       "no port but 0",
		"10-5":                        `range "10-5"`,
		"1-65536":                     `range "1-65536"`,
		"-5":                          `range "-5"`,
		"1024-29999,32768-65535,x-y,": `range "x-y"`,
	} {
		if _, _, err := ParsePortRanges("--nat-port-range", in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParsePortRanges(%q) error %v, want %q", in, err, want)
		}
	}
}
