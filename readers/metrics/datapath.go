package metrics

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipmasq/ipmasq/bpf"
)

// DatapathSource is what the datapath metrics read; bpf.Pinned is one. Every
// method returns an error wrapping bpf.ErrNotPinned before the datapath's
// maps exist.
type DatapathSource interface {
	// Counters returns the global datapath counters summed over CPUs,
	// indexed by bpf.Counter.
	Counters() ([]uint64, error)
	// DevCounters returns the per-device, family and direction outcome
	// counters summed over CPUs.
	DevCounters() ([]bpf.DevCounters, error)
	// NATFill returns the entries and capacity of each NAT map.
	NATFill() ([]bpf.NATMapFill, error)
	// UnmasqFill returns the records and capacity of each map of
	// unmasqueraded flows.
	UnmasqFill() ([]bpf.NATMapFill, error)
	// NATCounts returns the programs' counts of each NAT map's entries by
	// class (the same cost at any size of the maps).
	NATCounts() ([]bpf.NATCounts, error)
}

var _ DatapathSource = bpf.Pinned{}

const datapathPacketsHelp = "Deprecated (removed in the next release): use ipmasq_packets_total and ipmasq_drops_total. " +
	"Packets seen by the masquerade programs by bpf counter (label counter); the values overlap " +
	"(nat-new is part of masqueraded), so a sum means nothing."

var (
	datapathPacketsDesc = prometheus.NewDesc("ipmasq_datapath_packets_total", datapathPacketsHelp, []string{"counter"}, nil)
	packetsDesc         = prometheus.NewDesc("ipmasq_packets_total",
		"Packets the masquerade programs saw, per device, family (ipv4, ipv6, other: ARP and the rest, which pass), "+
			"direction (egress, ingress) and action: translated (source rewritten on egress, destination on ingress), "+
			"passed (left as it was), dropped. Every packet has exactly one action: the sum is every packet seen.",
		[]string{"family", "device", "direction", "action"}, nil)
	dropsDesc              = prometheus.NewDesc("ipmasq_drops_total", dropsHelp(), []string{"family", "device", "reason"}, nil)
	portSearchFailuresDesc = prometheus.NewDesc("ipmasq_nat_port_search_failures_total",
		"New flows refused because no NAT port was free toward their destination (the port search of the "+
			"--nat-port-range found none), per family; each one is also a drop with reason no-free-port.",
		[]string{"family"}, nil)
	natEntriesDesc = prometheus.NewDesc("ipmasq_nat_entries",
		"Entries of the NAT map of each family: two per masqueraded flow, one per inbound flow record or node flow hold.",
		[]string{"family"}, nil)
	natCapacityDesc = prometheus.NewDesc("ipmasq_nat_capacity",
		"Capacity (entries) of the NAT map of each family (--nat-max-entries); compare with ipmasq_nat_entries.",
		[]string{"family"}, nil)
	unmasqFlowsDesc = prometheus.NewDesc("ipmasq_unmasq_flows",
		"Flows from masquerade sources recorded as unmasqueraded (their destination was a non-masquerade one when they "+
			"started), per family: they keep that decision through config changes. The records are an LRU: at "+
			"ipmasq_unmasq_capacity the least recently used is evicted, and its flow decided again by its next packet.",
		[]string{"family"}, nil)
	unmasqCapacityDesc = prometheus.NewDesc("ipmasq_unmasq_capacity",
		"Capacity (records) of the map of unmasqueraded flows of each family: a quarter of --nat-max-entries.",
		[]string{"family"}, nil)
	natPairsDesc = prometheus.NewDesc("ipmasq_nat_pairs",
		"NAT pairs by family and kind (masquerade: translated flows; inbound: flows a remote opened to a masquerade source; "+
			"host: node flows holding a NAT port), as the datapath counts them (ipmasq-agent nat --count --kind). "+
			"By connection state: ipmasq-agent nat --summary.",
		[]string{"family", "kind"}, nil)
)

// datapathCollector reads the counters and NAT maps at scrape time.
type datapathCollector struct {
	src DatapathSource
	// deviceName names an interface index; ok=false for a device the agent
	// does not know (any more).
	deviceName func(ifindex int) (string, bool)
}

// dropsHelp is ipmasq_drops_total's help, its reasons read from the
// datapath's list (bpf.DropReason) so that a new reason is never left out.
func dropsHelp() string {
	var reasons []string
	for r := bpf.DropReason(0); r < bpf.NumDropReasons; r++ {
		reasons = append(reasons, r.String())
	}
	return "Packets the masquerade programs dropped, per device, family and reason: " + strings.Join(reasons, ", ") +
		" (docs/observability.md says when each happens). " +
		"Their sum over reasons equals ipmasq_packets_total{action=\"dropped\"} summed over directions."
}

func (c *datapathCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{datapathPacketsDesc, packetsDesc, dropsDesc, portSearchFailuresDesc,
		natEntriesDesc, natCapacityDesc, natPairsDesc, unmasqFlowsDesc, unmasqCapacityDesc} {
		ch <- d
	}
}

func (c *datapathCollector) Collect(ch chan<- prometheus.Metric) {
	// Every map is read before the first metric is sent: the registry's
	// gatherer, another goroutine, then wakes for them all at once, not
	// after each read (a wake-up between threads costs as much as a read).
	out := make([]prometheus.Metric, 0, 64)
	emit := func(m prometheus.Metric) { out = append(out, m) }
	counters, err := c.src.Counters()
	switch {
	case errors.Is(err, bpf.ErrNotPinned):
	case err != nil:
		emit(prometheus.NewInvalidMetric(datapathPacketsDesc, fmt.Errorf("read datapath counters: %w", err)))
	default:
		for i, v := range counters {
			emit(prometheus.MustNewConstMetric(datapathPacketsDesc, prometheus.CounterValue, float64(v), bpf.Counter(i).String()))
		}
	}
	c.collectDevices(emit)
	c.collectNAT(emit)
	c.collectUnmasq(emit)
	for _, m := range out {
		ch <- m
	}
}

func (c *datapathCollector) collectUnmasq(emit func(prometheus.Metric)) {
	fill, err := c.src.UnmasqFill()
	switch {
	case errors.Is(err, bpf.ErrNotPinned):
		return
	case err != nil:
		emit(prometheus.NewInvalidMetric(unmasqFlowsDesc, fmt.Errorf("read the unmasqueraded flows' records: %w", err)))
		return
	}
	for _, m := range fill {
		emit(prometheus.MustNewConstMetric(unmasqFlowsDesc, prometheus.GaugeValue, float64(m.Entries), m.Family))
		emit(prometheus.MustNewConstMetric(unmasqCapacityDesc, prometheus.GaugeValue, float64(m.Capacity), m.Family))
	}
}

func (c *datapathCollector) device(ifindex uint32) string {
	if c.deviceName != nil {
		if name, ok := c.deviceName(int(ifindex)); ok {
			return name
		}
	}
	// A device that is gone (or not known yet): its counters stay in the
	// map under its index.
	return "ifindex-" + strconv.FormatUint(uint64(ifindex), 10)
}

func (c *datapathCollector) collectDevices(emit func(prometheus.Metric)) {
	devs, err := c.src.DevCounters()
	switch {
	case errors.Is(err, bpf.ErrNotPinned):
		return
	case err != nil:
		emit(prometheus.NewInvalidMetric(packetsDesc, fmt.Errorf("read per-device counters: %w", err)))
		return
	}
	type dropKey struct {
		family, device string
		reason         bpf.DropReason
	}
	drops := map[dropKey]uint64{}
	portFailures := map[string]uint64{}
	for _, d := range devs {
		name := c.device(d.Ifindex)
		for a, n := range d.Packets {
			emit(prometheus.MustNewConstMetric(packetsDesc, prometheus.CounterValue, float64(n),
				d.Family, name, d.Direction, bpf.Action(a).String()))
		}
		// Drops are summed over directions: the label set stays small,
		// and the reason says where it happened.
		for r, n := range d.Drops {
			drops[dropKey{d.Family, name, bpf.DropReason(r)}] += n
		}
		if d.Family != "other" {
			portFailures[d.Family] += d.Drops[bpf.DropNoPort]
		}
	}
	for k, n := range drops {
		emit(prometheus.MustNewConstMetric(dropsDesc, prometheus.CounterValue, float64(n), k.family, k.device, k.reason.String()))
	}
	for _, family := range []string{"ipv4", "ipv6"} {
		emit(prometheus.MustNewConstMetric(portSearchFailuresDesc, prometheus.CounterValue, float64(portFailures[family]), family))
	}
}

func (c *datapathCollector) collectNAT(emit func(prometheus.Metric)) {
	fill, err := c.src.NATFill()
	switch {
	case errors.Is(err, bpf.ErrNotPinned):
		return
	case err != nil:
		emit(prometheus.NewInvalidMetric(natEntriesDesc, fmt.Errorf("read NAT occupancy: %w", err)))
		return
	}
	for _, m := range fill {
		emit(prometheus.MustNewConstMetric(natEntriesDesc, prometheus.GaugeValue, float64(m.Entries), m.Family))
		emit(prometheus.MustNewConstMetric(natCapacityDesc, prometheus.GaugeValue, float64(m.Capacity), m.Family))
	}

	counts, err := c.src.NATCounts()
	if err != nil {
		emit(prometheus.NewInvalidMetric(natPairsDesc, fmt.Errorf("read NAT pair counts: %w", err)))
		return
	}
	// Every family and kind, zero included: an alert on a kind needs the
	// series to exist before the first such pair.
	for _, fc := range counts {
		for kind := bpf.KindMasquerade; kind <= bpf.KindHost; kind++ {
			emit(prometheus.MustNewConstMetric(natPairsDesc, prometheus.GaugeValue, float64(fc.Of(kind)), fc.Family, kind.String()))
		}
	}
}
