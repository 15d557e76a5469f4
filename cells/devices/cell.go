package devices

import (
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"github.com/vishvananda/netns"

	"github.com/ipmasq/ipmasq/tables"
)

// Config is the devices cell's command-line configuration.
type Config struct {
	// Devices are the interface names or "prefix+" patterns of the devices
	// that masquerade; empty selects every device a forwarded packet can
	// leave through (a route in any table but local), the pods' own excepted.
	Devices []string `mapstructure:"devices"`
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.StringSlice("devices", def.Devices,
		"Devices to masquerade on: interface names or name prefixes ending in + (e.g. eth+); "+
			"empty selects every device the node forwards through (a default route, a route via a gateway or a connected subnet, in any table but local), never the pods' own interfaces")
}

// Netns is the network namespace whose devices the cell lists. Without one
// in the hive the cell lists the agent's own namespace (tests provide one
// with testkit/netnstest). The provider keeps ownership of the handle and
// must keep it open until the hive has stopped.
type Netns struct {
	Handle netns.NsHandle
}

// Cell provides the egress-devices table and keeps it in step with the
// network devices. It needs statedb.Cell, job.Cell and a cell.Health.
var Cell = cell.Module(
	"devices",
	"Network devices and which of them masquerade",

	cell.Config(Config{}),
	cell.ProvidePrivate(newWatcherFromParams),
	cell.Provide(
		func(w *watcher) statedb.RWTable[*tables.EgressDevice] { return w.table },
		func(w *watcher) statedb.Table[*tables.EgressDevice] { return w.table },
	),
	cell.Invoke(registerWatcher),
)

type watcherParams struct {
	cell.In

	Log    *slog.Logger
	DB     *statedb.DB
	Config Config
	Netns  *Netns `optional:"true"`
	// PodCIDRs, when the hive has them, tell the pods' gateways apart
	// from the uplinks.
	PodCIDRs statedb.Table[*tables.PodCIDR] `optional:"true"`
}

// newWatcherFromParams checks --devices and creates the table, uninitialized
// until the first complete dump.
func newWatcherFromParams(p watcherParams) (*watcher, error) {
	sel, err := parseSelector(p.Config.Devices)
	if err != nil {
		return nil, err
	}
	tbl, err := tables.NewEgressDeviceTable(p.DB)
	if err != nil {
		return nil, err
	}
	return newWatcher(p.Log, p.DB, tbl, sel, p.Netns, p.PodCIDRs), nil
}

func registerWatcher(w *watcher, jobs job.Registry, health cell.Health, log *slog.Logger) {
	g := jobs.NewGroup(health, job.WithLogger(log))
	g.Add(job.OneShot("watch-devices", w.run))
}
