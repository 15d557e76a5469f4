package ipam

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Config is the IPAM cell's command-line configuration.
type Config struct {
	// EgressRouteTable is the route table of an allocation that names none.
	EgressRouteTable uint32
	// IPAMConfigWait bounds how long an allocation waits for the first
	// config load.
	IPAMConfigWait time.Duration `mapstructure:"ipam-config-wait"`
}

// DefaultConfig is the configuration used when no flag is given.
var DefaultConfig = Config{
	IPAMConfigWait: 10 * time.Second,
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Uint32("egress-route-table", def.EgressRouteTable, "Route table of an allocation that names none (0: no per-endpoint ip rules)")
	flags.Duration("ipam-config-wait", def.IPAMConfigWait, "How long an allocation waits for the first masquerade config load before failing with 503")
}

// Cell provides the endpoints table and the IPAM.
var Cell = cell.Module(
	"ipam",
	"Endpoint address allocation with durable state",

	cell.Config(DefaultConfig),
	cell.Provide(
		newIPAM,
		func(i *IPAM) statedb.Table[*tables.Endpoint] { return i.endpoints },
	),
)

type ipamParams struct {
	cell.In

	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	DB        *statedb.DB
	Health    cell.Health
	Config    Config
	// Agent holds --state-dir, where the endpoints are kept.
	Agent settings.Config
	CIDRs statedb.Table[*tables.NonMasqCIDR]
	// PodCIDRs are the pools (podcidrs.Cell), followed live.
	PodCIDRs statedb.Table[*tables.PodCIDR]
	// Devices hold the node's own addresses, which are never handed out.
	Devices statedb.Table[*tables.EgressDevice] `optional:"true"`
	// Jobs runs the check for releases ipmasq-cni recorded while the
	// agent was unreachable; without it they are done at start only.
	Jobs job.Registry `optional:"true"`
}

// newIPAM creates the endpoints table; its start hook restores it from
// disk. A state that cannot be read is a start error: starting empty would
// hand out addresses that are in use. Nothing is read or written before
// the start, so building the hive (e.g. "ipmasq-agent hive", which prints
// the cells) leaves the state directory alone.
func newIPAM(p ipamParams) (*IPAM, error) {
	if p.Config.IPAMConfigWait < 0 {
		return nil, fmt.Errorf("--ipam-config-wait=%s: want a duration of 0 or more, e.g. 10s", p.Config.IPAMConfigWait)
	}
	endpoints, err := tables.NewEndpointTable(p.DB)
	if err != nil {
		return nil, err
	}
	i := &IPAM{
		log: p.Log, db: p.DB, endpoints: endpoints, cidrs: p.CIDRs,
		podCIDRs: p.PodCIDRs, devices: p.Devices, config: p.Config, stateDir: p.Agent.StateDir,
		health:        p.Health.NewScope("state"),
		compactHealth: p.Health.NewScope("compaction"),
		pendingHealth: p.Health.NewScope("pending-releases"),
	}
	p.Lifecycle.Append(cell.Hook{OnStart: i.start, OnStop: i.stop})
	if p.Jobs != nil {
		g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
		g.Add(job.OneShot("pending-releases", i.watchPending))
	}
	return i, nil
}

// start opens the state directory and restores the endpoints.
func (i *IPAM) start(cell.HookContext) error {
	store, err := NewStore(i.stateDir)
	if err != nil {
		return fmt.Errorf("--state-dir %s: %w", i.stateDir, err)
	}
	i.store = store
	if err := i.restore(); err != nil {
		i.store.Close()
		i.store = nil
		return err
	}
	// Before the API serves (its start hook comes after this one): the
	// DELs that ipmasq-cni could not send while the agent was away. A
	// failure keeps the addresses allocated and is retried.
	if err := i.releasePending(); err != nil {
		i.log.Warn("Releases recorded by ipmasq-cni not done; their addresses stay allocated, retried", "error", err)
	}
	return nil
}
