package metrics

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipmasq/ipmasq/bpf"
)

// fakeDatapath stands for bpf.Pinned.
type fakeDatapath struct {
	counters         []uint64
	v4, v6, capacity int
	countErr, natErr error
}

func (f *fakeDatapath) Counters() ([]uint64, error) { return f.counters, f.countErr }
func (f *fakeDatapath) NATOccupancy() (int, int, int, error) {
	return f.v4, f.v6, f.capacity, f.natErr
}

func TestDatapathCollector(t *testing.T) {
	src := &fakeDatapath{counters: make([]uint64, bpf.NumCounters), v4: 10, v6: 4, capacity: 131072}
	src.counters[bpf.CounterMasqueraded] = 1000
	src.counters[bpf.CounterNATNew] = 7
	src.counters[bpf.CounterNATFull] = 2
	c := &datapathCollector{src: src}

	var want strings.Builder
	want.WriteString("# HELP ipmasq_datapath_packets_total " + datapathPacketsHelp + "\n# TYPE ipmasq_datapath_packets_total counter\n")
	for i, v := range src.counters {
		fmt.Fprintf(&want, "ipmasq_datapath_packets_total{counter=%q} %d\n", bpf.Counter(i).String(), v)
	}
	want.WriteString(`# HELP ipmasq_nat_capacity Capacity of each NAT map (--nat-max-entries).
# TYPE ipmasq_nat_capacity gauge
ipmasq_nat_capacity 131072
# HELP ipmasq_nat_entries Entries of the NAT map (two per masqueraded flow).
# TYPE ipmasq_nat_entries gauge
ipmasq_nat_entries{family="ipv4"} 10
ipmasq_nat_entries{family="ipv6"} 4
`)
	if err := testutil.CollectAndCompare(c, strings.NewReader(want.String())); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(want.String(), `{counter="masqueraded"} 1000`) || !strings.Contains(want.String(), `{counter="drop-nat-table-full"} 2`) {
		t.Fatalf("counter names changed:\n%s", want.String())
	}

	// The counters are read at every scrape.
	src.counters[bpf.CounterMasqueraded] = 1500
	if err := testutil.CollectAndCompare(c, strings.NewReader(`
# HELP ipmasq_nat_entries Entries of the NAT map (two per masqueraded flow).
# TYPE ipmasq_nat_entries gauge
ipmasq_nat_entries{family="ipv4"} 10
ipmasq_nat_entries{family="ipv6"} 4
`), "ipmasq_nat_entries"); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	if got := gatheredValue(t, reg, "ipmasq_datapath_packets_total", "counter", "masqueraded"); got != 1500 {
		t.Fatalf("masqueraded after more traffic: %v, want 1500", got)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) > 0 {
		t.Fatalf("lint: %v %v", problems, err)
	}
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
	if len(families) != 1 || families[0].GetName() != "ipmasq_datapath_packets_total" {
		t.Fatalf("gathered %v, want the counters only", families)
	}
}

// gatheredValue returns the value of the series of name whose label is value.
func gatheredValue(t *testing.T, g prometheus.Gatherer, name, label, value string) float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range families {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					switch {
					case m.Counter != nil:
						return m.GetCounter().GetValue()
					case m.Gauge != nil:
						return m.GetGauge().GetValue()
					}
				}
			}
		}
	}
	t.Fatalf("no series %s{%s=%q}", name, label, value)
	return 0
}
