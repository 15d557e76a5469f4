package masqrules

import (
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/tables"
)

// Name is the reconciler's name: its health scope, metrics label and
// fault point.
const Name = "masq-rules"

// Cell reconciles masquerade-rule-sources into masq_rules_v4/v6. It needs
// datapath.Cell (the loaded datapath) and the masquerade-rule-sources table
// (cells/datapathtables).
var Cell = cell.Group(
	// The Operations, in the hive so that tests decorate them.
	cell.Provide(newOps),
	cell.Invoke(register),
)

func newOps(h *datapath.Handle) reconciler.Operations[*tables.MasqueradeRuleSource] {
	return datapath.MapOps(h, masqRuleOps)
}

type params struct {
	cell.In

	Log            *slog.Logger
	DB             *statedb.DB
	Jobs           job.Registry
	Health         cell.Health
	ModuleID       cell.FullModuleID
	DefaultMetrics reconciler.Metrics `optional:"true"`
	Table          statedb.RWTable[*tables.MasqueradeRuleSource]
	Ops            reconciler.Operations[*tables.MasqueradeRuleSource]
}

func register(p params) error {
	return datapath.Register(
		reconciler.Params{Log: p.Log, DB: p.DB, JobGroup: p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log)),
			ModuleID: p.ModuleID, DefaultMetrics: p.DefaultMetrics},
		Name, p.Table,
		(*tables.MasqueradeRuleSource).Clone, (*tables.MasqueradeRuleSource).SetStatus, (*tables.MasqueradeRuleSource).GetStatus,
		p.Ops)
}
