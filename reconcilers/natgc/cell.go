package natgc

import (
	"log/slog"
	"net/netip"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell expires idle NAT pairs every --nat-gc-interval (job nat-gc) and
// provides the datapath/gc command. It needs datapath.Cell (the loaded
// datapath and its lifetimes) and the node-addresses and
// masquerade-rule-sources tables.
var Cell = cell.Group(
	cell.Provide(newCollector, scriptCommands),
	cell.Invoke(register),
)

type params struct {
	cell.In

	Log       *slog.Logger
	DB        *statedb.DB
	Config    datapath.Config
	Handle    *datapath.Handle
	NodeAddrs statedb.Table[*tables.NodeAddress]
	// The masquerade rules' toAddress are SNAT addresses too.
	RuleSources statedb.Table[*tables.MasqueradeRuleSource]
}

func newCollector(p params) (*collector, error) {
	lifetimes, err := p.Config.Lifetimes()
	if err != nil {
		return nil, err
	}
	return &collector{log: p.Log, dp: p.Handle, lifetimes: lifetimes, snat: func() (map[netip.Addr]bool, bool) {
		return liveSNATAddrs(p.DB, p.NodeAddrs, p.RuleSources)
	}}, nil
}

func register(jobs job.Registry, health cell.Health, log *slog.Logger, cfg datapath.Config, c *collector) {
	g := jobs.NewGroup(health, job.WithLogger(log))
	g.Add(job.Timer("nat-gc", c.collect, cfg.NATGCInterval))
}

// scriptCommands are the shell and script-test commands of the collector:
//
//	datapath/gc        expire idle NAT pairs now
func scriptCommands(c *collector) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"datapath/gc": script.Command(
			script.CmdUsage{Summary: "Expire idle NAT entries now"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				return nil, c.collectNow()
			}),
	})
}

// liveSNATAddrs lists the addresses a NAT pair may keep: the node's
// addresses (a flow keeps the address it started with until that address is
// deleted, as with MASQUERADE; adding or reordering addresses changes only
// the choice for new flows) and the masquerade rules' toAddress, once the
// node-addresses table has been derived.
func liveSNATAddrs(db *statedb.DB, nodeAddrs statedb.Table[*tables.NodeAddress],
	rules statedb.Table[*tables.MasqueradeRuleSource]) (map[netip.Addr]bool, bool) {
	txn := db.ReadTxn()
	if init, _ := nodeAddrs.Initialized(txn); !init {
		return nil, false
	}
	out := map[netip.Addr]bool{}
	for a := range nodeAddrs.All(txn) {
		out[a.Addr] = true
	}
	for r := range rules.All(txn) {
		if r.ToAddress.IsValid() {
			out[r.ToAddress] = true
		}
	}
	return out, true
}
