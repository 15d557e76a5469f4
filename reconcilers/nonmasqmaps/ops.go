package nonmasqmaps

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"net/netip"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/tables"
)

type (
	v4Ops = bpfmap.Ops[*tables.NonMasqCIDR, bpfmap.LPMKeyV4, uint8]
	v6Ops = bpfmap.Ops[*tables.NonMasqCIDR, bpfmap.LPMKeyV6, uint8]
)

// ops sends each row to the map of its family. One table holds both
// families so that readers get one longest-match view.
type ops struct {
	v4 *v4Ops
	v6 *v6Ops
}

var (
	_ reconciler.Operations[*tables.NonMasqCIDR]      = (*ops)(nil)
	_ reconciler.BatchOperations[*tables.NonMasqCIDR] = (*ops)(nil)
)

func newOps(maps *Maps, tbl statedb.Table[*tables.NonMasqCIDR]) *ops {
	o := &ops{}
	if maps.V4 != nil {
		o.v4 = bpfmap.NewOps(maps.V4,
			func(c *tables.NonMasqCIDR) (bpfmap.LPMKeyV4, uint8) {
				return bpfmap.LPMKeyV4From(c.Prefix), uint8(c.Action)
			},
			bpfmap.WithDesired(desiredKeys(tbl, tables.IPv4, bpfmap.LPMKeyV4From)))
	}
	if maps.V6 != nil {
		o.v6 = bpfmap.NewOps(maps.V6,
			func(c *tables.NonMasqCIDR) (bpfmap.LPMKeyV6, uint8) {
				return bpfmap.LPMKeyV6From(c.Prefix), uint8(c.Action)
			},
			bpfmap.WithDesired(desiredKeys(tbl, tables.IPv6, bpfmap.LPMKeyV6From)))
	}
	return o
}

// desiredKeys lists the keys the table wants in one family's map; the map
// helper uses it to make room when stale entries fill the map.
func desiredKeys[K any](tbl statedb.Table[*tables.NonMasqCIDR], fam tables.Family, key func(netip.Prefix) K) func(statedb.ReadTxn) iter.Seq[K] {
	return func(txn statedb.ReadTxn) iter.Seq[K] {
		return func(yield func(K) bool) {
			for row := range tbl.All(txn) {
				if tables.FamilyOf(row.Prefix.Addr()) == fam && !yield(key(row.Prefix)) {
					return
				}
			}
		}
	}
}

func isV4(c *tables.NonMasqCIDR) bool { return tables.FamilyOf(c.Prefix.Addr()) == tables.IPv4 }

func errFamilyDisabled(c *tables.NonMasqCIDR) error {
	return fmt.Errorf("%s: %s is disabled, there is no map for it", c.Prefix, tables.FamilyOf(c.Prefix.Addr()))
}

// Update implements reconciler.Operations.
func (o *ops) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, c *tables.NonMasqCIDR) error {
	switch {
	case isV4(c) && o.v4 != nil:
		return o.v4.Update(ctx, txn, rev, c)
	case !isV4(c) && o.v6 != nil:
		return o.v6.Update(ctx, txn, rev, c)
	}
	return errFamilyDisabled(c)
}

// Delete implements reconciler.Operations.
func (o *ops) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, c *tables.NonMasqCIDR) error {
	switch {
	case isV4(c) && o.v4 != nil:
		return o.v4.Delete(ctx, txn, rev, c)
	case !isV4(c) && o.v6 != nil:
		return o.v6.Delete(ctx, txn, rev, c)
	}
	return nil
}

// Prune implements reconciler.Operations: each map is compared with the
// rows of its family.
func (o *ops) Prune(ctx context.Context, txn statedb.ReadTxn, objs iter.Seq2[*tables.NonMasqCIDR, statedb.Revision]) error {
	var errs []error
	if o.v4 != nil {
		if err := o.v4.Prune(ctx, txn, filter(objs, isV4)); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", MapNameV4, err))
		}
	}
	if o.v6 != nil {
		if err := o.v6.Prune(ctx, txn, filter(objs, func(c *tables.NonMasqCIDR) bool { return !isV4(c) })); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", MapNameV6, err))
		}
	}
	return errors.Join(errs...)
}

// UpdateBatch implements reconciler.BatchOperations.
func (o *ops) UpdateBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.NonMasqCIDR]) {
	o.splitBatch(batch,
		func(b []reconciler.BatchEntry[*tables.NonMasqCIDR]) { o.v4.UpdateBatch(ctx, txn, b) },
		func(b []reconciler.BatchEntry[*tables.NonMasqCIDR]) { o.v6.UpdateBatch(ctx, txn, b) })
}

// DeleteBatch implements reconciler.BatchOperations.
func (o *ops) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.NonMasqCIDR]) {
	o.splitBatch(batch,
		func(b []reconciler.BatchEntry[*tables.NonMasqCIDR]) { o.v4.DeleteBatch(ctx, txn, b) },
		func(b []reconciler.BatchEntry[*tables.NonMasqCIDR]) { o.v6.DeleteBatch(ctx, txn, b) })
}

// splitBatch runs the per-family batch operations and copies the results
// back into batch.
func (o *ops) splitBatch(batch []reconciler.BatchEntry[*tables.NonMasqCIDR], do4, do6 func([]reconciler.BatchEntry[*tables.NonMasqCIDR])) {
	// Sized up front: a 16 384-prefix config is one batch per family, and
	// growing these by appending was the largest allocation of a load.
	n4 := 0
	for _, e := range batch {
		if isV4(e.Object) {
			n4++
		}
	}
	idx4, idx6 := make([]int, 0, n4), make([]int, 0, len(batch)-n4)
	b4 := make([]reconciler.BatchEntry[*tables.NonMasqCIDR], 0, n4)
	b6 := make([]reconciler.BatchEntry[*tables.NonMasqCIDR], 0, len(batch)-n4)
	for i, e := range batch {
		if isV4(e.Object) {
			idx4, b4 = append(idx4, i), append(b4, e)
		} else {
			idx6, b6 = append(idx6, i), append(b6, e)
		}
	}
	run := func(idx []int, b []reconciler.BatchEntry[*tables.NonMasqCIDR], enabled bool, do func([]reconciler.BatchEntry[*tables.NonMasqCIDR])) {
		if len(b) == 0 {
			return
		}
		if !enabled {
			for _, i := range idx {
				batch[i].Result = errFamilyDisabled(batch[i].Object)
			}
			return
		}
		do(b)
		for j, i := range idx {
			batch[i].Result = b[j].Result
		}
	}
	run(idx4, b4, o.v4 != nil, do4)
	run(idx6, b6, o.v6 != nil, do6)
}

func filter(objs iter.Seq2[*tables.NonMasqCIDR, statedb.Revision], keep func(*tables.NonMasqCIDR) bool) iter.Seq2[*tables.NonMasqCIDR, statedb.Revision] {
	return func(yield func(*tables.NonMasqCIDR, statedb.Revision) bool) {
		for c, rev := range objs {
			if keep(c) && !yield(c, rev) {
				return
			}
		}
	}
}
