package nonmasqmaps

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell registers the reconciler that writes nonmasq-cidrs into the
// datapath's nonmasq tries. It needs the config cell (for the tables),
// settings.Cell, datapath.Cell (the loader, which owns the tries and loads
// them with the programs), statedb.Cell, job.Cell and a cell.Health; the
// agent puts it after the datapath module, so that the tries are loaded
// before its jobs start.
var Cell = cell.Module(
	"nonmasq-maps",
	"Writes the non-masquerade prefixes into the pinned BPF LPM maps",

	cell.ProvidePrivate(newJobGroup, newOps),
	// The Operations the reconciler runs, in the hive so that tests
	// decorate them (fault injection) the way statedb's example does.
	cell.Provide(
		func(o *mapOps) reconciler.Operations[*tables.NonMasqCIDR] { return o },
		func(o *mapOps) reconciler.BatchOperations[*tables.NonMasqCIDR] { return o },
	),
	cell.Provide(newHandle, scriptCommands),
	cell.Invoke(register),
)

// Handle gives other cells and script commands access to the maps once the
// cell has started.
type Handle struct {
	ops    *mapOps // nil in tests that provide Operations of their own
	pinDir string
	r      reconciler.Reconciler[*tables.NonMasqCIDR]
	db     *statedb.DB
	cidrs  statedb.Table[*tables.NonMasqCIDR]
}

// WaitReconciled waits until the reconciler has processed every change of
// the nonmasq-cidrs table up to now (successfully or not).
func (h *Handle) WaitReconciled(ctx context.Context) error {
	if h.r == nil {
		return fmt.Errorf("reconciler not registered")
	}
	_, _, err := h.r.WaitUntilReconciled(ctx, h.cidrs.Revision(h.db.ReadTxn()))
	return err
}

// Maps returns the maps the reconciler writes through, or nil until the
// datapath is loaded and the reconciler's first write.
func (h *Handle) Maps() *Maps {
	if h.ops == nil {
		return nil
	}
	v4, v6 := h.ops.Maps()
	if v4 == nil && v6 == nil {
		return nil
	}
	return &Maps{V4: v4, V6: v6}
}

// free is how many more entries the family's map takes, once the maps
// are built.
func (h *Handle) free(fam tables.Family) (int, bool) {
	maps := h.Maps()
	if maps == nil {
		return 0, false
	}
	switch {
	case fam == tables.IPv4 && maps.V4 != nil:
		return maps.V4.Free(), true
	case fam == tables.IPv6 && maps.V6 != nil:
		return maps.V6.Free(), true
	}
	return 0, false
}

func newHandle(agent settings.Config, ops *mapOps) *Handle {
	return &Handle{ops: ops, pinDir: agent.PinDir()}
}

func newJobGroup(r job.Registry, h cell.Health, log *slog.Logger) job.Group {
	return r.NewGroup(h, job.WithLogger(log))
}

type registerParams struct {
	cell.In

	datapath.ReconcilerParams
	Agent    settings.Config
	Group    job.Group
	CIDRs    statedb.RWTable[*tables.NonMasqCIDR]
	Status   statedb.Table[*tables.ConfigStatus]
	Handle   *Handle
	Ops      reconciler.Operations[*tables.NonMasqCIDR]
	BatchOps reconciler.BatchOperations[*tables.NonMasqCIDR]
}

// reconcilerName is the reconciler's name: its health scope
// (job-reconcile-nonmasq-maps) and metrics label.
const reconcilerName = "nonmasq-maps"

// register registers statedb's reconciler of nonmasq-cidrs, as every
// datapath map is reconciled, with batches: a round takes every row a new
// config changes (each new prefix written, then each old one deleted, both
// families: newBeforeOld), so that a config of 16 384 prefixes is one batch
// write per map and one status commit.
func register(p registerParams) error {
	r, err := datapath.RegisterBatched(p.ReconcilerParams, reconcilerName, p.CIDRs,
		(*tables.NonMasqCIDR).Clone, (*tables.NonMasqCIDR).SetStatus, (*tables.NonMasqCIDR).GetStatus,
		p.Ops, newBeforeOld{p.BatchOps, p.CIDRs, p.Handle.free}, 4*int(p.Agent.MaxNonMasqCIDRs))
	if err != nil {
		return err
	}
	p.Handle.r, p.Handle.db, p.Handle.cidrs = r, p.DB, p.CIDRs
	// The reconciler prunes when the table is initialized (and hourly);
	// the config's resyncInterval drives the full passes in between.
	p.Group.Add(job.OneShot("resync", func(ctx context.Context, _ cell.Health) error {
		return resyncLoop(ctx, p.DB, p.Status, r)
	}))
	return nil
}

// resyncLoop compares the maps with the kernel (prune + repair) every
// resyncInterval of the applied config.
func resyncLoop(ctx context.Context, db *statedb.DB, status statedb.Table[*tables.ConfigStatus], r reconciler.Reconciler[*tables.NonMasqCIDR]) error {
	last := time.Now()
	for {
		interval := time.Minute
		rows, watch := status.AllWatch(db.ReadTxn())
		for st := range rows {
			if st.ResyncInterval > 0 {
				interval = st.ResyncInterval
			}
		}
		timer := time.NewTimer(time.Until(last.Add(interval)))
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-watch:
			// The interval may have changed: recompute the deadline.
			timer.Stop()
		case <-timer.C:
			r.Prune()
			last = time.Now()
		}
	}
}
