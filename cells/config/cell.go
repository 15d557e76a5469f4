package config

import (
	"context"
	"log/slog"
	"path/filepath"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/cells/agentconfig"
	"github.com/ipmasq/ipmasq/tables"
)

// DefaultPath is where the Kubernetes ip-masq-agent reads its config.
const DefaultPath = "/etc/config/ip-masq-agent"

// Config is the config cell's command-line configuration.
type Config struct {
	// IPMasqAgentConfigPath is the config file; its directory is watched.
	IPMasqAgentConfigPath string `mapstructure:"ip-masq-agent-config-path"`
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("ip-masq-agent-config-path", def.IPMasqAgentConfigPath,
		"ip-masq-agent config file (YAML or JSON); its directory is watched for changes")
}

// Cell provides the nonmasq-cidrs and ipmasq-config tables and keeps them in
// step with the config file. It needs statedb.Cell, job.Cell, a cell.Health
// and agentconfig.Cell.
var Cell = cell.Module(
	"config",
	"ip-masq-agent config file",

	cell.Config(Config{IPMasqAgentConfigPath: DefaultPath}),
	cell.Provide(
		tables.NewNonMasqCIDRTable,
		statedb.RWTable[*tables.NonMasqCIDR].ToTable,
		tables.NewConfigStatusTable,
		statedb.RWTable[*tables.ConfigStatus].ToTable,
	),
	cell.Invoke(registerLoader),
)

type loaderParams struct {
	cell.In

	Log    *slog.Logger
	DB     *statedb.DB
	Jobs   job.Registry
	Health cell.Health
	Agent  agentconfig.Config
	Config Config
	CIDRs  statedb.RWTable[*tables.NonMasqCIDR]
	Status statedb.RWTable[*tables.ConfigStatus]
}

func registerLoader(p loaderParams) error {
	path, err := filepath.Abs(p.Config.IPMasqAgentConfigPath)
	if err != nil {
		return err
	}
	l := newLoader(p.Log, p.DB, p.CIDRs, p.Status, path, Limits{
		EnableIPv4:        p.Agent.EnableIPv4,
		EnableIPv6:        p.Agent.EnableIPv6,
		MaxCIDRsPerFamily: int(p.Agent.MaxNonMasqCIDRs),
	})
	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	g.Add(job.OneShot("watch-config", func(ctx context.Context, health cell.Health) error {
		return l.run(ctx, health)
	}))
	return nil
}
