package metrics

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipmasq/ipmasq/bpf"
)

// fakeDatapath stands for bpf.Pinned (the real pins are read by the
// end-to-end tests, testkit/e2e TestMetrics).
type fakeDatapath struct {
	counters         []uint64
	devs             []bpf.DevCounters
	fill, unmasq     []bpf.NATMapFill
	counts           []bpf.NATCounts
	countErr, natErr error
}

func (f *fakeDatapath) Counters() ([]uint64, error)             { return f.counters, f.countErr }
func (f *fakeDatapath) DevCounters() ([]bpf.DevCounters, error) { return f.devs, f.countErr }
func (f *fakeDatapath) NATFill() ([]bpf.NATMapFill, error)      { return f.fill, f.natErr }
func (f *fakeDatapath) UnmasqFill() ([]bpf.NATMapFill, error)   { return f.unmasq, f.natErr }
func (f *fakeDatapath) NATCounts() ([]bpf.NATCounts, error)     { return f.counts, f.natErr }

func TestDatapathCollector(t *testing.T) {
	src := &fakeDatapath{counters: make([]uint64, bpf.NumCounters),
		fill:   []bpf.NATMapFill{{Family: "ipv4", Entries: 10, Capacity: 131072}, {Family: "ipv6", Entries: 4, Capacity: 131072}},
		unmasq: []bpf.NATMapFill{{Family: "ipv4", Entries: 25, Capacity: 32768}, {Family: "ipv6", Entries: 3, Capacity: 32768}}}
	src.counters[bpf.CounterMasqueraded] = 1000
	src.counters[bpf.CounterNATNew] = 7
	src.counters[bpf.CounterNATFull] = 2
	eth0 := bpf.DevCounters{Ifindex: 2, Family: "ipv4", Direction: "egress"}
	eth0.Packets = [bpf.NumActions]uint64{bpf.ActionPassed: 5, bpf.ActionTranslated: 1000, bpf.ActionDropped: 3}
	eth0.Drops[bpf.DropNATFull] = 2
	eth0.Drops[bpf.DropNoPort] = 1
	eth0In := bpf.DevCounters{Ifindex: 2, Family: "ipv4", Direction: "ingress"}
	eth0In.Packets = [bpf.NumActions]uint64{bpf.ActionTranslated: 900, bpf.ActionDropped: 1}
	eth0In.Drops[bpf.DropError] = 1
	gone := bpf.DevCounters{Ifindex: 9, Family: "ipv6", Direction: "egress"}
	gone.Packets[bpf.ActionPassed] = 4
	src.devs = []bpf.DevCounters{eth0, eth0In, gone}
	src.counts = []bpf.NATCounts{{Family: "ipv4", Masquerade: 2, Reply: 2, Inbound: 1}, {Family: "ipv6", Masquerade: 1, Reply: 1}}
	c := &datapathCollector{src: src, deviceName: func(i int) (string, bool) { return "eth0", i == 2 }}

	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"ipmasq_packets_total", map[string]string{"family": "ipv4", "device": "eth0", "direction": "egress", "action": "translated"}, 1000},
		{"ipmasq_packets_total", map[string]string{"family": "ipv4", "device": "eth0", "direction": "egress", "action": "dropped"}, 3},
		{"ipmasq_packets_total", map[string]string{"family": "ipv4", "device": "eth0", "direction": "ingress", "action": "translated"}, 900},
		{"ipmasq_packets_total", map[string]string{"family": "ipv6", "device": "ifindex-9", "direction": "egress", "action": "passed"}, 4},
		{"ipmasq_drops_total", map[string]string{"family": "ipv4", "device": "eth0", "reason": "nat-table-full"}, 2},
		{"ipmasq_drops_total", map[string]string{"family": "ipv4", "device": "eth0", "reason": "no-free-port"}, 1},
		{"ipmasq_drops_total", map[string]string{"family": "ipv4", "device": "eth0", "reason": "error"}, 1}, // ingress
		{"ipmasq_drops_total", map[string]string{"family": "ipv4", "device": "eth0", "reason": "untranslatable"}, 0},
		{"ipmasq_nat_port_search_failures_total", map[string]string{"family": "ipv4"}, 1},
		{"ipmasq_nat_port_search_failures_total", map[string]string{"family": "ipv6"}, 0},
		{"ipmasq_nat_entries", map[string]string{"family": "ipv4"}, 10},
		{"ipmasq_nat_capacity", map[string]string{"family": "ipv6"}, 131072},
		{"ipmasq_unmasq_flows", map[string]string{"family": "ipv4"}, 25},
		{"ipmasq_unmasq_flows", map[string]string{"family": "ipv6"}, 3},
		{"ipmasq_unmasq_capacity", map[string]string{"family": "ipv4"}, 32768},
		{"ipmasq_nat_pairs", map[string]string{"family": "ipv4", "kind": "masquerade"}, 2},
		{"ipmasq_nat_pairs", map[string]string{"family": "ipv6", "kind": "masquerade"}, 1},
		{"ipmasq_nat_pairs", map[string]string{"family": "ipv4", "kind": "inbound"}, 1},
		{"ipmasq_nat_pairs", map[string]string{"family": "ipv4", "kind": "host"}, 0},
		{"ipmasq_datapath_packets_total", map[string]string{"counter": "masqueraded"}, 1000},
		{"ipmasq_datapath_packets_total", map[string]string{"counter": "drop-nat-table-full"}, 2},
	} {
		if got := gatheredSeries(t, reg, tc.name, tc.labels); got != tc.want {
			t.Errorf("%s%v = %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) > 0 {
		t.Fatalf("lint: %v %v", problems, err)
	}

	// The counters and the pairs' counts are read at every scrape.
	src.devs[0].Packets[bpf.ActionTranslated] = 1500
	src.counts[0].Masquerade = 1
	if got := gatheredSeries(t, reg, "ipmasq_packets_total", map[string]string{"device": "eth0", "direction": "egress", "action": "translated"}); got != 1500 {
		t.Fatalf("translated after more traffic: %v, want 1500", got)
	}
	if got := gatheredSeries(t, reg, "ipmasq_nat_pairs", map[string]string{"family": "ipv4", "kind": "masquerade"}); got != 1 {
		t.Fatalf("pairs after one ended: %v, want 1", got)
	}
}

// gatheredSeries returns the value of the series of name with these labels
// (and any others).
func gatheredSeries(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range families {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue series
				}
			}
			switch {
			case m.Counter != nil:
				return m.GetCounter().GetValue()
			case m.Gauge != nil:
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return 0
}

// TestDatapathCollectorNotLoaded: before the datapath runs there is
// nothing to report, and that is not an error.
func TestDatapathCollectorNotLoaded(t *testing.T) {
	c := &datapathCollector{src: &fakeDatapath{countErr: bpf.ErrNotPinned, natErr: bpf.ErrNotPinned}}
	if n := testutil.CollectAndCount(c); n != 0 {
		t.Fatalf("collected %d metrics before the datapath is loaded, want 0", n)
	}
	// The real pins say so too.
	c = &datapathCollector{src: bpf.Pinned{Dir: t.TempDir()}}
	if n := testutil.CollectAndCount(c); n != 0 {
		t.Fatalf("collected %d metrics from a pin directory without maps, want 0", n)
	}
}

// TestDatapathCollectorError: a failed NAT read costs the NAT metrics and
// is reported, the counters are still served.
func TestDatapathCollectorError(t *testing.T) {
	c := &datapathCollector{src: &fakeDatapath{
		counters: make([]uint64, bpf.NumCounters),
		natErr:   errors.New("map iteration: operation not permitted"),
	}}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	families, err := reg.Gather()
	if err == nil || !strings.Contains(err.Error(), "read NAT occupancy: map iteration: operation not permitted") {
		t.Fatalf("Gather error: %v", err)
	}
	var names []string
	for _, mf := range families {
		names = append(names, mf.GetName())
	}
	if !slices.Equal(names, []string{"ipmasq_datapath_packets_total", "ipmasq_nat_port_search_failures_total"}) {
		t.Fatalf("gathered %v, want the counters only", names)
	}
}

// TestDropsHelpNamesEveryReason: the help of ipmasq_drops_total lists every
// reason the datapath can drop for (it once left out no-pair).
func TestDropsHelpNamesEveryReason(t *testing.T) {
	help := dropsHelp()
	for r := bpf.DropReason(0); r < bpf.NumDropReasons; r++ {
		if !strings.Contains(help, " "+r.String()+",") && !strings.Contains(help, " "+r.String()+" (") {
			t.Errorf("ipmasq_drops_total's help does not name reason %s: %s", r, help)
		}
	}
}
