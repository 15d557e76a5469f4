package egressrules

import (
	"errors"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/tables"
)

// Config is the rules controller's command-line configuration.
type Config struct {
	// EgressRulePriority is the priority of the per-endpoint rules.
	EgressRulePriority uint32
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Uint32("egress-rule-priority", def.EgressRulePriority,
		"Priority of the per-endpoint ip rules; masquerade exceptions nested in a range use the priorities just below it")
}

// Cell provides the ip-rules table and keeps it derived from endpoints and
// nonmasq-cidrs.
var Cell = cell.Module(
	"egress-rules",
	"Derives per-endpoint ip rules from endpoints and the masquerade config",

	cell.Config(Config{EgressRulePriority: 111}),
	cell.Provide(
		newIPRuleTable,
		statedb.RWTable[*tables.IPRule].ToTable,
	),
	cell.Invoke(registerController),
)

// initializerName marks ip-rules initialized once the first derivation from
// initialized inputs is in; the kernel reconciler prunes only after it.
const initializerName = "egress-rules"

func newIPRuleTable(db *statedb.DB) (statedb.RWTable[*tables.IPRule], error) {
	return tables.NewIPRuleTable(db)
}

type controllerParams struct {
	cell.In

	Log       *slog.Logger
	DB        *statedb.DB
	Jobs      job.Registry
	Health    cell.Health
	Config    Config
	CIDRs     statedb.Table[*tables.NonMasqCIDR]
	Endpoints statedb.Table[*tables.Endpoint]
	Rules     statedb.RWTable[*tables.IPRule]
}

func registerController(p controllerParams) error {
	if p.Config.EgressRulePriority == 0 {
		return errors.New("--egress-rule-priority=0: priority 0 is the kernel's local table rule; use e.g. 111")
	}
	wtxn := p.DB.WriteTxn(p.Rules)
	markInit := p.Rules.RegisterInitializer(wtxn, initializerName)
	wtxn.Commit()
	c := newController(p, markInit)
	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	g.Add(job.OneShot("derive-rules", c.run))
	return nil
}
