package metrics

import (
	"context"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipmasq/ipmasq/tables"
)

var (
	configValidDesc = prometheus.NewDesc("ipmasq_config_valid",
		"1 if the newest config file content is the applied one, 0 if it was rejected (the last good config stays applied).", nil, nil)
	configGenerationDesc = prometheus.NewDesc("ipmasq_config_generation",
		"Generation of the applied config, as in the ipmasq-config table and the log.", nil, nil)
	configLastGoodLoadDesc = prometheus.NewDesc("ipmasq_config_last_good_load_timestamp_seconds",
		"When a config file (or its absence) was last accepted, including periodic re-reads; 0 before the first.", nil, nil)
	configNonMasqPrefixesDesc = prometheus.NewDesc("ipmasq_config_nonmasq_prefixes",
		"No-masquerade prefixes of the applied config, link-local and defaults included.", []string{"family"}, nil)
	configMasqPrefixesDesc = prometheus.NewDesc("ipmasq_config_masquerade_prefixes",
		"masqueradeCIDRs exceptions of the applied config.", nil, nil)
	configMasqRulesDesc = prometheus.NewDesc("ipmasq_config_masquerade_rules",
		"masqueradeRules entries of the applied config.", nil, nil)
	configWarningsDesc = prometheus.NewDesc("ipmasq_config_warnings",
		"Warnings of the applied config, by kind: unknown-key (a key the format does not know, ignored), conflict (merged files that disagree, resolved) and odd (content read as the Kubernetes agent reads it that most likely says something else: a repeated key, a second YAML document, resyncInterval 0s); the config/status command and the log name each.", []string{"kind"}, nil)
)

// configWarningKinds are the kinds ipmasq_config_warnings always has, 0 or not.
var configWarningKinds = []tables.ConfigWarningKind{tables.ConfigWarningUnknownKey, tables.ConfigWarningConflict, tables.ConfigWarningOdd}

// configCollector reads the ipmasq-config table at scrape time.
type configCollector struct {
	db    *statedb.DB
	table statedb.Table[*tables.ConfigStatus]
}

func (c *configCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{configValidDesc, configGenerationDesc, configLastGoodLoadDesc,
		configNonMasqPrefixesDesc, configMasqPrefixesDesc, configMasqRulesDesc, configWarningsDesc} {
		ch <- d
	}
}

func (c *configCollector) Collect(ch chan<- prometheus.Metric) {
	// The table has one row, the config file's.
	for st := range c.table.All(c.db.ReadTxn()) {
		valid := 0.0
		if st.Healthy() {
			valid = 1
		}
		var lastGood float64
		if !st.LastGoodLoad.IsZero() {
			lastGood = float64(st.LastGoodLoad.UnixNano()) / 1e9
		}
		gauge := func(d *prometheus.Desc, v float64, labels ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
		}
		gauge(configValidDesc, valid)
		gauge(configGenerationDesc, float64(st.Generation))
		gauge(configLastGoodLoadDesc, lastGood)
		gauge(configNonMasqPrefixesDesc, float64(st.NoMasqV4), tables.IPv4.String())
		gauge(configNonMasqPrefixesDesc, float64(st.NoMasqV6), tables.IPv6.String())
		gauge(configMasqPrefixesDesc, float64(st.MasqExceptions))
		gauge(configMasqRulesDesc, float64(st.MasqueradeRules))
		for _, kind := range configWarningKinds {
			n := 0
			for _, w := range st.Warnings {
				if w.Kind == kind {
					n++
				}
			}
			gauge(configWarningsDesc, float64(n), string(kind))
		}
		return
	}
}

// configLoads counts config loads and rejections as they happen, from the
// changes of the ipmasq-config table: a scrape sees only the newest row.
type configLoads struct {
	db    *statedb.DB
	table statedb.Table[*tables.ConfigStatus]

	loads    prometheus.Counter
	failures prometheus.Counter

	seen map[string]configSeen // by path; only run's goroutine uses it
}

type configSeen struct {
	generation uint64
	lastError  string
}

func newConfigLoads(db *statedb.DB, table statedb.Table[*tables.ConfigStatus]) *configLoads {
	return &configLoads{
		db:    db,
		table: table,
		loads: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ipmasq_config_loads_total",
			Help: "Config loads that changed the applied config (increases of its generation); re-reading an unchanged file does not count.",
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ipmasq_config_load_failures_total",
			Help: "Config files rejected (the last good config stays applied); a periodic re-read of the same rejected file does not count again.",
		}),
		seen: map[string]configSeen{},
	}
}

func (l *configLoads) Describe(ch chan<- *prometheus.Desc) {
	l.loads.Describe(ch)
	l.failures.Describe(ch)
}

func (l *configLoads) Collect(ch chan<- prometheus.Metric) {
	l.loads.Collect(ch)
	l.failures.Collect(ch)
}

// run counts until ctx ends. Loads that happened before it started (the
// first one runs while the table is constructed) count at its first look.
func (l *configLoads) run(ctx context.Context, _ cell.Health) error {
	for {
		rows, watch := l.table.AllWatch(l.db.ReadTxn())
		for st := range rows {
			l.observe(st)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		}
	}
}

// observe counts what changed since the row was last seen. Two loads
// between two looks count as one failure at most (a rejection is seen by
// its error, which the next good load clears), but every generation counts.
func (l *configLoads) observe(st *tables.ConfigStatus) {
	prev := l.seen[st.Path]
	if st.Generation > prev.generation {
		l.loads.Add(float64(st.Generation - prev.generation))
	}
	if st.LastError != "" && st.LastError != prev.lastError {
		l.failures.Inc()
	}
	l.seen[st.Path] = configSeen{generation: st.Generation, lastError: st.LastError}
}
