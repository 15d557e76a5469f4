package masqrules

import (
	"github.com/cilium/hive/cell"
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

func register(p datapath.ReconcilerParams, tbl statedb.RWTable[*tables.MasqueradeRuleSource],
	ops reconciler.Operations[*tables.MasqueradeRuleSource]) error {
	return datapath.Register(p, Name, tbl, (*tables.MasqueradeRuleSource).Clone, (*tables.MasqueradeRuleSource).SetStatus,
		(*tables.MasqueradeRuleSource).GetStatus, ops)
}
