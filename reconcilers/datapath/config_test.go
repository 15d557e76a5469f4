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
	for list, want := range map[string]bool{"": false, "40000-40100": true, "1,39000-41000": true, "40000": false, "40050-40200": false} {
		if got := containsRange(list, PortRange{40000, 40100}); got != want {
			t.Errorf("containsRange(%q) = %v, want %v", list, got, want)
		}
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

// TestParsePortRanges: --nat-port-range takes several ranges (upstream's
// --to-ports=1024-29999,32768-65535), refusing overlaps and more than the
// datapath holds.
func TestParsePortRanges(t *testing.T) {
	for in, want := range map[string]string{
		"61000-65535": "61000-65535", "1024-29999,32768-65535": "1024-29999,32768-65535",
		" 80 , 1024-2048": "80-80,1024-2048", "1,2,3,4,5,6,7,8": "1-1,2-2,3-3,4-4,5-5,6-6,7-7,8-8",
	} {
		got, err := ParsePortRanges("--nat-port-range", in)
		if err != nil || got.String() != want {
			t.Errorf("ParsePortRanges(%q) = %v, %v; want %s", in, got, err, want)
		}
	}
	for in, want := range map[string]string{
		"1024-2048,2000-3000":         "ranges 1024-2048 and 2000-3000 overlap",
		"1024-2048,":                  `range "": want min-max`,
		"1,2,3,4,5,6,7,8,9":           "9 ranges, at most 8 are supported",
		"1024-2048,0-5":               `range "0-5"`,
		"61000":                       "want min-max",
		"1024-29999,32768-65535,x-y,": `range "x-y"`,
	} {
		if _, err := ParsePortRanges("--nat-port-range", in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParsePortRanges(%q) error %v, want %q", in, err, want)
		}
	}
}
