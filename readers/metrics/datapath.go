package metrics

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/tables"
)

// DatapathSource is what the datapath metrics read; bpf.Pinned is one. Both
// methods return an error wrapping bpf.ErrNotPinned before the datapath's
// maps exist.
type DatapathSource interface {
	// Counters returns the datapath counters summed over CPUs, indexed by
	// bpf.Counter.
	Counters() ([]uint64, error)
	// NATOccupancy returns the entries of the IPv4 and IPv6 NAT maps and
	// the capacity of each.
	NATOccupancy() (v4, v6, capacity int, err error)
}

var _ DatapathSource = bpf.Pinned{}

const datapathPacketsHelp = "Packets seen by the masquerade programs, by what happened to them " +
	"(label counter: the bpf counter names; nat-new counts the packets that created a NAT pair, i.e. new flows)."

var (
	datapathPacketsDesc = prometheus.NewDesc("ipmasq_datapath_packets_total", datapathPacketsHelp, []string{"counter"}, nil)
	natEntriesDesc      = prometheus.NewDesc("ipmasq_nat_entries",
		"Entries of the NAT map (two per masqueraded flow).", []string{"family"}, nil)
	natCapacityDesc = prometheus.NewDesc("ipmasq_nat_capacity",
		"Capacity of each NAT map (--nat-max-entries).", nil, nil)
)

// datapathCollector reads the counters and NAT maps at scrape time.
type datapathCollector struct {
	src DatapathSource
}

func (c *datapathCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- datapathPacketsDesc
	ch <- natEntriesDesc
	ch <- natCapacityDesc
}

func (c *datapathCollector) Collect(ch chan<- prometheus.Metric) {
	counters, err := c.src.Counters()
	switch {
	case errors.Is(err, bpf.ErrNotPinned):
	case err != nil:
		ch <- prometheus.NewInvalidMetric(datapathPacketsDesc, fmt.Errorf("read datapath counters: %w", err))
	default:
		for i, v := range counters {
			ch <- prometheus.MustNewConstMetric(datapathPacketsDesc, prometheus.CounterValue, float64(v), bpf.Counter(i).String())
		}
	}

	v4, v6, capacity, err := c.src.NATOccupancy()
	switch {
	case errors.Is(err, bpf.ErrNotPinned):
	case err != nil:
		ch <- prometheus.NewInvalidMetric(natEntriesDesc, fmt.Errorf("read NAT occupancy: %w", err))
	default:
		ch <- prometheus.MustNewConstMetric(natEntriesDesc, prometheus.GaugeValue, float64(v4), tables.IPv4.String())
		ch <- prometheus.MustNewConstMetric(natEntriesDesc, prometheus.GaugeValue, float64(v6), tables.IPv6.String())
		ch <- prometheus.MustNewConstMetric(natCapacityDesc, prometheus.GaugeValue, float64(capacity))
	}
}
