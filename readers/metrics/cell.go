package metrics

import (
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Config is the metrics cell's command-line configuration.
type Config struct {
	// PrometheusServeAddr is the TCP address of the metrics and health
	// server, e.g. ":9963" or "127.0.0.1:9963"; empty disables it.
	PrometheusServeAddr string `mapstructure:"prometheus-serve-addr"`
}

// DefaultConfig serves nothing: metrics are opt-in.
var DefaultConfig = Config{}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("prometheus-serve-addr", def.PrometheusServeAddr,
		"Serve Prometheus metrics (/metrics), health (/healthz), readiness (/readyz) and liveness (/livez) on this TCP address, e.g. :9963; empty: off")
}

// Cell serves the metrics and /healthz on --prometheus-serve-addr and
// provides the hive's reconciler.Metrics and the *Server. It needs
// statedb.Cell, job.Cell and a cell.Health; it reads cell.SimpleHealth for
// /healthz, and the ipmasq tables and handles that are present.
//
// Place it after nonmasqmaps.Cell: the maps handle is filled in by that
// cell's start hook, which must run before the server can be scraped.
var Cell = cell.Module(
	"metrics",
	"Prometheus metrics and health over HTTP",

	cell.Config(DefaultConfig),
	registration,
	cell.Provide(newServer),
	cell.Invoke((*Server).register),
)

// registration is every metric the cell registers, in its own registry:
// the module's private *prometheus.Registry that the server exposes (and
// the test of the metric lists reads).
var registration = cell.Group(
	cell.ProvidePrivate(newRegistry),
	cell.Provide(newReconcilerMetrics),
	cell.Invoke(registerCollectors),
)

// newRegistry is the cell's own registry: a host hive's registry (if any)
// is not touched, and the exposition holds only ipmasq_*, go_* and
// process_* metrics. ipmasq_build_info is there from the start, like the
// Go and process metrics.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		newBuildInfo(),
	)
	return reg
}

// sources is everything the metrics read. All of it is optional so that a
// hive embedding a subset of the ipmasq cells still gets their metrics.
type sources struct {
	cell.In

	Log       *slog.Logger
	Registry  *prometheus.Registry
	DB        *statedb.DB
	Jobs      job.Registry
	Health    cell.Health
	Lifecycle cell.Lifecycle

	Agent        settings.Config                             `optional:"true"`
	ConfigStatus statedb.Table[*tables.ConfigStatus]         `optional:"true"`
	Endpoints    statedb.Table[*tables.Endpoint]             `optional:"true"`
	IPRules      statedb.Table[*tables.IPRule]               `optional:"true"`
	CIDRs        statedb.Table[*tables.NonMasqCIDR]          `optional:"true"`
	Devices      statedb.Table[*tables.DatapathDevice]       `optional:"true"`
	Links        statedb.Table[*tables.EgressDevice]         `optional:"true"`
	RuleSources  statedb.Table[*tables.MasqueradeRuleSource] `optional:"true"`
	Netfilter    statedb.Table[*tables.NetfilterNATRule]     `optional:"true"`
	Variant      tables.DatapathVariant                      `optional:"true"`
}

func registerCollectors(s sources) error {
	var cs []prometheus.Collector
	if s.ConfigStatus != nil {
		loads := newConfigLoads(s.DB, s.ConfigStatus)
		g := s.Jobs.NewGroup(s.Health, job.WithLogger(s.Log))
		g.Add(job.OneShot("count-config-loads", loads.run))
		cs = append(cs, loads, &configCollector{db: s.DB, table: s.ConfigStatus})
	}
	if s.Variant.Variant != "" {
		cs = append(cs, newDatapathInfo(s.Variant))
	}
	if rows := newRowCollector(s); rows != nil {
		cs = append(cs, rows)
	}
	// The maps are read from their pins under --bpf-root: the collectors
	// work whatever the start order, and report nothing until the maps exist.
	// A scrape reuses the maps the last one opened (each checked against
	// its pin), so that it costs a few syscalls, not four per map opened.
	pinned := bpf.Pinned{Dir: s.Agent.PinDir()}.Cached()
	s.Lifecycle.Append(cell.Hook{OnStop: func(cell.HookContext) error { return pinned.Close() }})
	if s.CIDRs != nil && s.Agent.BPFRoot != "" {
		cs = append(cs, &mapsCollector{maps: pinned, capacity: s.Agent.MaxNonMasqCIDRs})
	}
	if s.Devices != nil && s.Agent.BPFRoot != "" {
		cs = append(cs, &datapathCollector{src: pinned, deviceName: deviceNames(s.DB, s.Links)})
	}
	for _, c := range cs {
		if err := s.Registry.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// deviceNames names interface indexes from the egress-devices table (every
// device of the node), read at scrape time.
func deviceNames(db *statedb.DB, links statedb.Table[*tables.EgressDevice]) func(int) (string, bool) {
	if links == nil {
		return nil
	}
	return func(ifindex int) (string, bool) {
		d, _, ok := links.Get(db.ReadTxn(), tables.EgressDeviceByIndex.Query(ifindex))
		if !ok {
			return "", false
		}
		return d.Name, true
	}
}
