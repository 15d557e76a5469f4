package metrics

import (
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
)

// rowCollector reports the row counts of the tables that are present, at
// scrape time (NumObjects is O(1), however many rules there are).
type rowCollector struct {
	db     *statedb.DB
	counts []rowCount
}

type rowCount struct {
	desc  *prometheus.Desc
	count func(statedb.ReadTxn) int
}

func newRowCollector(s sources) *rowCollector {
	c := &rowCollector{db: s.DB}
	add := func(name, help string, count func(statedb.ReadTxn) int) {
		c.counts = append(c.counts, rowCount{prometheus.NewDesc(name, help, nil, nil), count})
	}
	if s.Endpoints != nil {
		add("ipmasq_endpoints", "Endpoint addresses allocated by IPAM (table endpoints).", s.Endpoints.NumObjects)
	}
	if s.IPRules != nil {
		add("ipmasq_ip_rules", "Desired per-endpoint ip rules (table ip-rules).", s.IPRules.NumObjects)
	}
	if s.Devices != nil {
		add("ipmasq_datapath_devices", "Devices the masquerade programs are to be attached to (table datapath-devices).", s.Devices.NumObjects)
	}
	if s.RuleSources != nil {
		add("ipmasq_masquerade_rule_sources", "masqueradeRules sources resolved on matching devices (table masquerade-rule-sources).", s.RuleSources.NumObjects)
	}
	if s.Netfilter != nil {
		add("ipmasq_netfilter_nat_rules", "Netfilter NAT rules that decide before ipmasq: IP-MASQ-AGENT chains, MASQUERADE/SNAT rules matching pod sources, iptables-legacy nat tables (table netfilter-nat-rules; docs/migrate.md).", s.Netfilter.NumObjects)
	}
	if len(c.counts) == 0 {
		return nil
	}
	return c
}

func (c *rowCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, rc := range c.counts {
		ch <- rc.desc
	}
}

func (c *rowCollector) Collect(ch chan<- prometheus.Metric) {
	txn := c.db.ReadTxn()
	for _, rc := range c.counts {
		ch <- prometheus.MustNewConstMetric(rc.desc, prometheus.GaugeValue, float64(rc.count(txn)))
	}
}
