package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/tables"
)

var (
	nonMasqMapEntriesDesc = prometheus.NewDesc("ipmasq_nonmasq_map_entries",
		"Entries of the non-masquerade BPF map, as of the last write (the reconciler's copy; no syscall per scrape).", []string{"family"}, nil)
	nonMasqMapCapacityDesc = prometheus.NewDesc("ipmasq_nonmasq_map_capacity",
		"Capacity of the non-masquerade BPF map (--max-nonmasq-cidrs).", []string{"family"}, nil)
)

// mapsCollector reports the non-masquerade maps of the enabled families
// once they are open.
type mapsCollector struct {
	maps     *nonmasqmaps.Handle
	capacity uint32
}

func (c *mapsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- nonMasqMapEntriesDesc
	ch <- nonMasqMapCapacityDesc
}

func (c *mapsCollector) Collect(ch chan<- prometheus.Metric) {
	maps := c.maps.Maps()
	if maps == nil {
		return // not started yet
	}
	family := func(f tables.Family, entries int) {
		ch <- prometheus.MustNewConstMetric(nonMasqMapEntriesDesc, prometheus.GaugeValue, float64(entries), f.String())
		if c.capacity > 0 {
			ch <- prometheus.MustNewConstMetric(nonMasqMapCapacityDesc, prometheus.GaugeValue, float64(c.capacity), f.String())
		}
	}
	if maps.V4 != nil {
		family(tables.IPv4, maps.V4.Stats().Entries)
	}
	if maps.V6 != nil {
		family(tables.IPv6, maps.V6.Stats().Entries)
	}
}
