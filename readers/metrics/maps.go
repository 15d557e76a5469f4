package metrics

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipmasq/ipmasq/bpf"
)

var (
	nonMasqMapEntriesDesc = prometheus.NewDesc("ipmasq_nonmasq_map_entries",
		"Entries of the non-masquerade BPF map, read from the pinned map at scrape time.", []string{"family"}, nil)
	nonMasqMapCapacityDesc = prometheus.NewDesc("ipmasq_nonmasq_map_capacity",
		"Capacity of the non-masquerade BPF map (--max-nonmasq-cidrs).", []string{"family"}, nil)
)

// NonMasqSource is what the map metrics read; bpf.Pinned is one. It returns
// an error wrapping bpf.ErrNotPinned before the maps exist.
type NonMasqSource interface {
	// NonMasqEntries returns the entries of each family's map.
	NonMasqEntries() (map[string]int, error)
}

var _ NonMasqSource = bpf.Pinned{}

// mapsCollector reports the non-masquerade maps of the enabled families
// once they are pinned. It reads the pins, not the reconciler, so a scrape
// does not depend on the reconciler having started.
type mapsCollector struct {
	maps     NonMasqSource
	capacity uint32
}

func (c *mapsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- nonMasqMapEntriesDesc
	ch <- nonMasqMapCapacityDesc
}

func (c *mapsCollector) Collect(ch chan<- prometheus.Metric) {
	entries, err := c.maps.NonMasqEntries()
	switch {
	case errors.Is(err, bpf.ErrNotPinned):
		return // not started yet
	case err != nil:
		ch <- prometheus.NewInvalidMetric(nonMasqMapEntriesDesc, fmt.Errorf("read nonmasq maps: %w", err))
		return
	}
	for _, family := range []string{"ipv4", "ipv6"} {
		n, ok := entries[family]
		if !ok {
			continue
		}
		ch <- prometheus.MustNewConstMetric(nonMasqMapEntriesDesc, prometheus.GaugeValue, float64(n), family)
		if c.capacity > 0 {
			ch <- prometheus.MustNewConstMetric(nonMasqMapCapacityDesc, prometheus.GaugeValue, float64(c.capacity), family)
		}
	}
}
