package nonmasqmaps

import (
	"context"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// mapOps are the Operations of the tries.
type mapOps = bpfmap.Ops[*tables.NonMasqCIDR, bpf.LPMKeyV4, bpf.LPMKeyV6, uint8]

// newOps sends each row to the trie of its family, as loaded by the
// datapath's loader (datapath.Handle, their bpfmap.Loader). One table
// holds both families so that readers get one longest-match view. When a
// trie is full, the entries no row of the table wants make room (the
// stale prefixes of a previous config, before the first prune). A row's
// key is made from its prefix, the table's primary key, so rows have
// distinct keys.
func newOps(dp *datapath.Handle, agent settings.Config, cidrs statedb.Table[*tables.NonMasqCIDR]) *mapOps {
	e := bpfmap.Entries[*tables.NonMasqCIDR, bpf.LPMKeyV4, bpf.LPMKeyV6, uint8]{
		Is4: func(c *tables.NonMasqCIDR) bool { return tables.FamilyOf(c.Prefix.Addr()) == tables.IPv4 },
		V4: func(c *tables.NonMasqCIDR) (bpf.LPMKeyV4, uint8) {
			return bpf.LPMKeyV4From(c.Prefix), uint8(c.Action)
		},
		V6: func(c *tables.NonMasqCIDR) (bpf.LPMKeyV6, uint8) {
			return bpf.LPMKeyV6From(c.Prefix), uint8(c.Action)
		},
		Name:         func(c *tables.NonMasqCIDR) string { return c.Prefix.String() },
		Table:        cidrs,
		DistinctKeys: true,
	}
	if agent.EnableIPv4 {
		e.MapV4 = bpf.MapNonMasqV4
	}
	if agent.EnableIPv6 {
		e.MapV6 = bpf.MapNonMasqV6
	}
	return bpfmap.NewOps(dp, e)
}

// newBeforeOld are batch operations whose rounds write the table's new
// rows before they delete the old ones. statedb's reconciler hands a round's
// deletes over first, to make room; for a trie that would leave the
// destinations of a reshaped range (10.0.0.0/8 replaced by its two /9s)
// with neither their old nor their new prefix between the two writes, and
// their packets masqueraded. Written first, every destination keeps its old
// or gets its new decision throughout (its longest match is one of the
// two). The update after the delete costs nothing: the map's cache already
// holds the entries. When the old and the new rows do not fit in a map
// together, that family keeps the old order (deletes first): the early
// write would fail for want of room, and making room deletes the old rows.
type newBeforeOld struct {
	reconciler.BatchOperations[*tables.NonMasqCIDR]
	tbl statedb.Table[*tables.NonMasqCIDR]
	// free is how many more entries a family's map takes; known is false
	// before the maps are built (Handle.free).
	free func(tables.Family) (n int, known bool)
}

// DeleteBatch writes the rows still to be written that fit beside the old
// ones, then deletes batch.
func (o newBeforeOld) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.NonMasqCIDR]) {
	if pending := o.pendingThatFit(txn); len(pending) > 0 {
		// The results are the round's update's to report: it writes
		// these rows again (a failure here is retried there).
		o.BatchOperations.UpdateBatch(ctx, txn, pending)
	}
	o.BatchOperations.DeleteBatch(ctx, txn, batch)
}

// pendingThatFit are the rows still to be written of each family whose map
// has room for all of them (or whose room is not known yet).
func (o newBeforeOld) pendingThatFit(txn statedb.ReadTxn) []reconciler.BatchEntry[*tables.NonMasqCIDR] {
	byFamily := map[tables.Family][]reconciler.BatchEntry[*tables.NonMasqCIDR]{}
	for row, rev := range o.tbl.All(txn) {
		if row.Status.IsPendingOrRefreshing() {
			fam := tables.FamilyOf(row.Prefix.Addr())
			byFamily[fam] = append(byFamily[fam], reconciler.BatchEntry[*tables.NonMasqCIDR]{Object: row, Revision: rev})
		}
	}
	var out []reconciler.BatchEntry[*tables.NonMasqCIDR]
	for _, fam := range []tables.Family{tables.IPv4, tables.IPv6} {
		if free, known := o.free(fam); !known || len(byFamily[fam]) <= free {
			out = append(out, byFamily[fam]...)
		}
	}
	return out
}
