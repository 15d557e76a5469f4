package config

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// DefaultPath is where the Kubernetes ip-masq-agent reads its config.
const DefaultPath = "/etc/config/ip-masq-agent"

// Config is the config cell's command-line configuration.
type Config struct {
	// IPMasqAgentConfigPath is the config file; its directory is watched.
	IPMasqAgentConfigPath string `mapstructure:"ip-masq-agent-config-path"`
	// NoMasqAllReservedRanges is the Kubernetes agent's flag of the same
	// name: a file without nonMasqueradeCIDRs (or no file) gets every
	// RFC-reserved IPv4 range as defaults instead of RFC 1918's three.
	NoMasqAllReservedRanges bool `mapstructure:"nomasq-all-reserved-ranges"`
	// IPMasqAgentV2 reads the files as Azure's ip-masq-agent-v2 does (AKS):
	// a file without nonMasqueradeCIDRs, or with no content, lists none;
	// the defaults apply only when no file is there; cidrLimit is ignored.
	IPMasqAgentV2 bool `mapstructure:"ip-masq-agent-v2"`
	// ResyncInterval is ip-masq-agent-v2's flag: the refresh interval in
	// seconds when the file sets no resyncInterval.
	ResyncInterval int `mapstructure:"resync-interval"`
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("ip-masq-agent-config-path", def.IPMasqAgentConfigPath,
		"ip-masq-agent config file (YAML or JSON); its directory is watched for changes")
	flags.Bool("nomasq-all-reserved-ranges", def.NoMasqAllReservedRanges,
		"Without nonMasqueradeCIDRs in the file, leave every RFC-reserved IPv4 range unmasqueraded (100.64.0.0/10, 192.0.0.0/24, ..., 240.0.0.0/4), not only RFC 1918's, as the Kubernetes ip-masq-agent's flag does")
	flags.Bool("ip-masq-agent-v2", def.IPMasqAgentV2,
		"Read the config files as Azure's ip-masq-agent-v2 (AKS) does: a file without nonMasqueradeCIDRs, or empty, lists none (no defaults unless no file is there), cidrLimit is ignored")
	flags.Int("resync-interval", def.ResyncInterval,
		"Seconds between re-reads of the config files and repairs of the maps when the file sets no resyncInterval (ip-masq-agent-v2's flag; 0 or less: 60)")
}

// resync returns the refresh interval --resync-interval asks for, and a
// warning when it is not above 0 (ip-masq-agent-v2 then re-reads without
// pause).
func (c Config) resync() (time.Duration, string) {
	if c.ResyncInterval <= 0 {
		return DefaultResyncInterval, fmt.Sprintf("--resync-interval=%d is not above 0; ip-masq-agent-v2 then re-reads its files without pause, ipmasq every %s (and at once on every change)",
			c.ResyncInterval, DefaultResyncInterval)
	}
	return time.Duration(c.ResyncInterval) * time.Second, ""
}

// Cell provides the nonmasq-cidrs, masquerade-rules and ipmasq-config
// tables and keeps them in step with the config file. It needs statedb.Cell, job.Cell, a cell.Health
// and settings.Cell.
//
// The file is first loaded while the tables are constructed, so every
// consumer of the tables (whatever its place in the hive) sees the loaded
// config even in its start hook; only a first file that is invalid leaves
// the table uninitialized until a good one arrives.
var Cell = cell.Module(
	"config",
	"ip-masq-agent config file",

	cell.Config(Config{IPMasqAgentConfigPath: DefaultPath, ResyncInterval: int(DefaultResyncInterval / time.Second)}),
	cell.ProvidePrivate(newLoaderFromParams),
	cell.Provide(
		func(l *loader) statedb.RWTable[*tables.NonMasqCIDR] { return l.cidrs },
		func(l *loader) statedb.Table[*tables.NonMasqCIDR] { return l.cidrs },
		func(l *loader) statedb.Table[*tables.ConfigStatus] { return l.status },
		func(l *loader) statedb.Table[*tables.MasqueradeRule] { return l.rules },
	),
	cell.Invoke(registerWatcher),
)

type loaderParams struct {
	cell.In

	Log    *slog.Logger
	DB     *statedb.DB
	Health cell.Health
	Agent  settings.Config
	Config Config
}

// newLoaderFromParams creates the tables and loads the file once.
func newLoaderFromParams(p loaderParams) (*loader, error) {
	if p.Config.IPMasqAgentConfigPath == "" {
		return nil, fmt.Errorf("--ip-masq-agent-config-path is empty: give the config file's path, e.g. %s", DefaultPath)
	}
	path, err := filepath.Abs(p.Config.IPMasqAgentConfigPath)
	if err != nil {
		return nil, err
	}
	cidrs, err := tables.NewNonMasqCIDRTable(p.DB)
	if err != nil {
		return nil, err
	}
	status, err := tables.NewConfigStatusTable(p.DB)
	if err != nil {
		return nil, err
	}
	rules, err := tables.NewMasqueradeRuleTable(p.DB)
	if err != nil {
		return nil, err
	}
	l := newLoader(p.Log, p.DB, cidrs, status, rules, path, Limits{
		EnableIPv4:        p.Agent.EnableIPv4,
		EnableIPv6:        p.Agent.EnableIPv6,
		MaxCIDRsPerFamily: int(p.Agent.MaxNonMasqCIDRs),
		AllReservedRanges: p.Config.NoMasqAllReservedRanges,
		V2:                p.Config.IPMasqAgentV2,
	}, p.Health.NewScope("config-file"))
	var warning string
	if l.defaultResync, warning = p.Config.resync(); warning != "" {
		p.Log.Warn("Flag adjusted: " + warning)
	}
	l.resync = l.defaultResync
	l.load()
	return l, nil
}

func registerWatcher(l *loader, jobs job.Registry, health cell.Health, log *slog.Logger) {
	g := jobs.NewGroup(health, job.WithLogger(log))
	g.Add(job.OneShot("watch-config", func(ctx context.Context, _ cell.Health) error {
		return l.run(ctx)
	}))
}
