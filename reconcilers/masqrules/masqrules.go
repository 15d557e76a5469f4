// Package masqrules writes table masquerade-rule-sources (the config's
// masquerade rules, per device and source prefix) into the datapath's maps
// masq_rules_v4/v6. It is built like reconcilers/nodeaddrs.
package masqrules

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
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

// entries writes each rule source into the map of its family, keyed by
// the egress device and the source prefix.
var entries = bpfmap.Entries[*tables.MasqueradeRuleSource, bpf.MasqRuleKeyV4, bpf.MasqRuleKeyV6, bpf.MasqRule]{
	MapV4: bpf.MapMasqRulesV4, MapV6: bpf.MapMasqRulesV6,
	Is4: func(s *tables.MasqueradeRuleSource) bool { return s.Source.Addr().Is4() },
	V4: func(s *tables.MasqueradeRuleSource) (bpf.MasqRuleKeyV4, bpf.MasqRule) {
		return bpf.MasqRuleKeyV4From(s.Ifindex, s.Source), bpf.MasqRuleTo(s.ToAddress)
	},
	V6: func(s *tables.MasqueradeRuleSource) (bpf.MasqRuleKeyV6, bpf.MasqRule) {
		return bpf.MasqRuleKeyV6From(s.Ifindex, s.Source), bpf.MasqRuleTo(s.ToAddress)
	},
	Name: func(s *tables.MasqueradeRuleSource) string { return s.Source.String() + " on " + s.Device },
}

func newOps(h *datapath.Handle) reconciler.Operations[*tables.MasqueradeRuleSource] {
	return bpfmap.NewOps(h, entries)
}

func register(p datapath.ReconcilerParams, tbl statedb.RWTable[*tables.MasqueradeRuleSource],
	ops reconciler.Operations[*tables.MasqueradeRuleSource]) error {
	return datapath.Register(p, Name, tbl, (*tables.MasqueradeRuleSource).Clone, (*tables.MasqueradeRuleSource).SetStatus,
		(*tables.MasqueradeRuleSource).GetStatus, ops)
}
