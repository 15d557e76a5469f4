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
