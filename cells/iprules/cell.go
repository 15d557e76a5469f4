package iprules

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
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
	c := &controller{params: p, markInitialized: markInit}
	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	g.Add(job.OneShot("derive-rules", c.run))
	return nil
}

type controller struct {
	params          controllerParams
	markInitialized func(statedb.WriteTxn)
}

// run re-derives the rules after every change of either input.
func (c *controller) run(ctx context.Context, health cell.Health) error {
	p := c.params
	for {
		txn := p.DB.ReadTxn()
		cidrsInit, cidrsWatch := p.CIDRs.Initialized(txn)
		epsInit, epsWatch := p.Endpoints.Initialized(txn)
		if !cidrsInit || !epsInit {
			// Deriving from a partial view would delete rules that are
			// still wanted. (An initialized table's watch channel is
			// closed: waiting on it would spin.)
			if cidrsInit {
				cidrsWatch = nil
			}
			if epsInit {
				epsWatch = nil
			}
			select {
			case <-ctx.Done():
				return nil
			case <-cidrsWatch:
			case <-epsWatch:
			}
			continue
		}
		cidrRows, cidrsChanged := p.CIDRs.AllWatch(txn)
		epRows, epsChanged := p.Endpoints.AllWatch(txn)
		added, deleted, errs := c.sync(statedb.Collect(cidrRows), statedb.Collect(epRows))
		if len(errs) > 0 {
			health.Degraded("some prefixes get no ip rule", errors.Join(errs...))
		} else {
			health.OK(fmt.Sprintf("%d rule(s)", p.Rules.NumObjects(p.DB.ReadTxn())))
		}
		if added+deleted > 0 {
			p.Log.Debug("ip rules derived", "added", added, "deleted", deleted)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-cidrsChanged:
		case <-epsChanged:
		}
	}
}

// sync makes the ip-rules table hold exactly the derived rules, touching
// only the rows that change.
func (c *controller) sync(cidrs []*tables.NonMasqCIDR, eps []*tables.Endpoint) (added, deleted int, errs []error) {
	p := c.params
	v4, v6, errs := templates(cidrs, p.Config.EgressRulePriority)
	want := desired(eps, v4, v6)

	wtxn := p.DB.WriteTxn(p.Rules)
	for r := range p.Rules.All(wtxn) {
		if _, ok := want[r.Key()]; ok {
			delete(want, r.Key())
			continue
		}
		p.Rules.Delete(wtxn, r)
		deleted++
	}
	for k := range want {
		p.Rules.Insert(wtxn, &tables.IPRule{
			Priority: k.Priority, From: k.From, To: k.To, Table: k.Table,
			Status: reconciler.StatusPending(),
		})
		added++
	}
	if c.markInitialized != nil {
		c.markInitialized(wtxn)
		c.markInitialized = nil
	}
	wtxn.Commit()
	return added, deleted, errs
}
