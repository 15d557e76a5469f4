package faults

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// Decorate wraps cells so that the Operations of the agent's kernel-writing
// reconcilers, which they provide in the hive, go through the hive's
// *Injector under their fault points: production code knows nothing of
// faults. The hive must provide an *Injector and all six Operations (the
// whole agent.Cell does).
//
//	hive.New(agent.Infrastructure, faults.Decorate(agent.Cell),
//		cell.Provide(func() *faults.Injector { return inj }))
func Decorate(cells ...cell.Cell) cell.Cell {
	return cell.Decorate(decorate, cells...)
}

func decorate(
	inj *Injector,
	nonMasq reconciler.Operations[*tables.NonMasqCIDR],
	nonMasqBatch reconciler.BatchOperations[*tables.NonMasqCIDR],
	ipRules reconciler.Operations[*tables.IPRule],
	attach reconciler.Operations[*tables.DatapathDevice],
	masqRules reconciler.Operations[*tables.MasqueradeRuleSource],
	masqSources reconciler.Operations[*tables.MasqueradeSource],
	nodeAddrs reconciler.Operations[*tables.NodeAddress],
) (
	reconciler.Operations[*tables.NonMasqCIDR],
	reconciler.BatchOperations[*tables.NonMasqCIDR],
	reconciler.Operations[*tables.IPRule],
	reconciler.Operations[*tables.DatapathDevice],
	reconciler.Operations[*tables.MasqueradeRuleSource],
	reconciler.Operations[*tables.MasqueradeSource],
	reconciler.Operations[*tables.NodeAddress],
) {
	return Wrap(inj, NonMasqMaps, nonMasq),
		WrapBatch(inj, NonMasqMaps, nonMasqBatch),
		Wrap(inj, IPRules, ipRules),
		Wrap(inj, TCAttach, attach),
		Wrap(inj, MasqRules, masqRules),
		Wrap(inj, MasqSources, masqSources),
		Wrap(inj, NodeAddresses, nodeAddrs)
}
