package nonmasqmaps

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell registers the reconciler that writes nonmasq-cidrs into the pinned
// maps. It needs the config cell (for the tables), settings.Cell,
// statedb.Cell, job.Cell and a cell.Health.
var Cell = cell.Module(
	"nonmasq-maps",
	"Writes the non-masquerade prefixes into the pinned BPF LPM maps",

	cell.ProvidePrivate(newJobGroup, newLazyOps),
	// The Operations the reconciler runs, in the hive so that tests
	// decorate them (fault injection) the way statedb's example does.
	cell.Provide(
		func(o *bpfmap.Lazy[*tables.NonMasqCIDR]) reconciler.Operations[*tables.NonMasqCIDR] { return o },
		func(o *bpfmap.Lazy[*tables.NonMasqCIDR]) reconciler.BatchOperations[*tables.NonMasqCIDR] { return o },
	),
	cell.Provide(newHandle, scriptCommands),
	cell.Invoke(register),
)

// Handle gives other cells and script commands access to the maps once the
// cell has started.
type Handle struct {
	maps  *Maps
	r     reconciler.Reconciler[*tables.NonMasqCIDR]
	db    *statedb.DB
	cidrs statedb.Table[*tables.NonMasqCIDR]
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

// Maps returns the open maps, or nil before start.
func (h *Handle) Maps() *Maps { return h.maps }

func newHandle() *Handle { return &Handle{} }

func newJobGroup(r job.Registry, h cell.Health, log *slog.Logger) job.Group {
	return r.NewGroup(h, job.WithLogger(log))
}

type registerParams struct {
	cell.In

	reconciler.Params
	Lifecycle cell.Lifecycle
	Agent     settings.Config
	CIDRs     statedb.RWTable[*tables.NonMasqCIDR]
	Status    statedb.Table[*tables.ConfigStatus]
	Handle    *Handle
	Ops       reconciler.Operations[*tables.NonMasqCIDR]
	BatchOps  reconciler.BatchOperations[*tables.NonMasqCIDR]
}

// errMapsNotOpen fails the map operations until the start hook has opened
// the maps.
var errMapsNotOpen = errors.New("nonmasq maps not open yet")

// newLazyOps are the map operations, built from the maps at first use: the
// start hook opens the maps before the reconciler's jobs (appended to the
// lifecycle after it) run, as datapath.MapOps does for the loaded
// datapath's maps.
func newLazyOps(h *Handle, cidrs statedb.Table[*tables.NonMasqCIDR]) *bpfmap.Lazy[*tables.NonMasqCIDR] {
	return bpfmap.NewLazy(func() (reconciler.Operations[*tables.NonMasqCIDR], error) {
		maps := h.Maps()
		if maps == nil {
			return nil, errMapsNotOpen
		}
		return newOps(maps, cidrs), nil
	})
}

func register(p registerParams) error {
	// The maps are opened when the hive starts, before the reconciler's jobs
	// (appended to the lifecycle after this hook) run.
	p.Lifecycle.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			maps, err := OpenMaps(p.Log, p.Agent)
			if err != nil {
				return err
			}
			p.Handle.maps = maps
			return nil
		},
		OnStop: func(cell.HookContext) error {
			if p.Handle.maps != nil {
				p.Handle.maps.Close()
			}
			return nil
		},
	})
	metrics := p.DefaultMetrics
	if metrics == nil {
		metrics = reconciler.NewUnpublishedExpVarMetrics()
	}
	r := newMapReconciler(p.Log, p.DB, p.CIDRs, p.Ops, p.BatchOps, metrics, p.ModuleID)
	// The first prune comes when the table is initialized; later full
	// passes are driven by the config's resyncInterval (resyncLoop).
	p.JobGroup.Add(job.OneShot("reconcile-"+reconcilerName, r.run))
	p.Handle.r, p.Handle.db, p.Handle.cidrs = r, p.DB, p.CIDRs
	p.JobGroup.Add(job.OneShot("resync", func(ctx context.Context, _ cell.Health) error {
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
