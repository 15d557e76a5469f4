package datapath

import (
	"context"
	"iter"
	"log/slog"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/ipmasq/ipmasq/bpf"
)

// MapOps are the Operations of a reconciler that writes a table into maps
// of the loaded datapath: build makes them from the maps at first use,
// since the maps exist only once the start hook has loaded the collection;
// before that every operation fails with ErrNotLoaded (and is retried).
// A map reconciler provides MapOps(h, build) in the hive and registers
// them with Register (see reconcilers/nodeaddrs).
func MapOps[Obj any](h *Handle, build func(*bpf.Datapath) (reconciler.Operations[Obj], error)) reconciler.Operations[Obj] {
	return &lazyOps[Obj]{dp: h, build: build}
}

// lazyOps builds its operations at first use.
type lazyOps[Obj any] struct {
	dp    *Handle
	build func(*bpf.Datapath) (reconciler.Operations[Obj], error)

	mu  sync.Mutex
	ops reconciler.Operations[Obj]
}

func (l *lazyOps[Obj]) get() (reconciler.Operations[Obj], error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ops != nil {
		return l.ops, nil
	}
	dp := l.dp.Get()
	if dp == nil {
		return nil, ErrNotLoaded
	}
	ops, err := l.build(dp)
	if err != nil {
		return nil, err
	}
	l.ops = ops
	return ops, nil
}

// Update implements reconciler.Operations.
func (l *lazyOps[Obj]) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Update(ctx, txn, rev, obj)
}

// Delete implements reconciler.Operations.
func (l *lazyOps[Obj]) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Delete(ctx, txn, rev, obj)
}

// Prune implements reconciler.Operations.
func (l *lazyOps[Obj]) Prune(ctx context.Context, txn statedb.ReadTxn, objs iter.Seq2[Obj, statedb.Revision]) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Prune(ctx, txn, objs)
}

// ReconcilerParams are what Register needs of the hive besides the table
// and its Operations; a reconciler's registration takes them as a
// parameter.
type ReconcilerParams struct {
	cell.In

	Log            *slog.Logger
	DB             *statedb.DB
	Jobs           job.Registry
	Health         cell.Health
	ModuleID       cell.FullModuleID
	DefaultMetrics reconciler.Metrics `optional:"true"`
}

// Register registers the reconciler of one table of the datapath, in a job
// group of its own under the module's health, with the options every
// datapath reconciler shares: full pruning hourly (what a restart or an
// outside writer changed is repaired), no refresh, rounds of up to 1000
// rows with no rate limit. name is the reconciler's name (its health scope
// and metrics label).
func Register[Obj comparable](p ReconcilerParams, name string, tbl statedb.RWTable[Obj],
	clone func(Obj) Obj, setStatus func(Obj, reconciler.Status) Obj, getStatus func(Obj) reconciler.Status,
	ops reconciler.Operations[Obj]) error {
	rp := reconciler.Params{Log: p.Log, DB: p.DB, JobGroup: p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log)),
		ModuleID: p.ModuleID, DefaultMetrics: p.DefaultMetrics}
	_, err := reconciler.Register(rp, tbl, clone, setStatus, getStatus, ops, nil,
		reconciler.WithName(name),
		reconciler.WithPruning(time.Hour),
		reconciler.WithRefreshing(0, nil),
		reconciler.WithRoundLimits(1000, rate.NewLimiter(rate.Inf, 1)),
	)
	return err
}
