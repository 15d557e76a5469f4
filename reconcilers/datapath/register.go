package datapath

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"
)

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
// datapath reconciler shares: full pruning when the table is initialized
// and hourly after (what a restart or an outside writer changed is
// repaired), no refresh, rounds of up to 1000 rows with no rate limit.
// name is the reconciler's name (its health scope and metrics label).
func Register[Obj comparable](p ReconcilerParams, name string, tbl statedb.RWTable[Obj],
	clone func(Obj) Obj, setStatus func(Obj, reconciler.Status) Obj, getStatus func(Obj) reconciler.Status,
	ops reconciler.Operations[Obj]) error {
	_, err := registerMap(p, name, tbl, clone, setStatus, getStatus, ops, nil, defaultRoundSize)
	return err
}

// defaultRoundSize is how many changed rows a round of Register's
// reconcilers takes before it commits their statuses.
const defaultRoundSize = 1000

// RegisterBatched is Register for a table written in batches: the
// reconciler hands each round's changed rows to batchOps (deletes first, to
// make room, then updates; a failed row is retried alone through ops), and
// a round takes up to roundSize rows, so that a whole new config is one
// batch write per map and one status commit. Give roundSize room for every
// row of the old config deleted and every row of the new one written (for
// a map of N entries per family, 4 N). It returns the reconciler for
// WaitUntilReconciled and Prune (reconcilers/nonmasqmaps).
func RegisterBatched[Obj comparable](p ReconcilerParams, name string, tbl statedb.RWTable[Obj],
	clone func(Obj) Obj, setStatus func(Obj, reconciler.Status) Obj, getStatus func(Obj) reconciler.Status,
	ops reconciler.Operations[Obj], batchOps reconciler.BatchOperations[Obj], roundSize int) (reconciler.Reconciler[Obj], error) {
	if batchOps == nil {
		return nil, fmt.Errorf("reconciler %s: RegisterBatched needs BatchOperations", name)
	}
	return registerMap(p, name, tbl, clone, setStatus, getStatus, ops, batchOps, roundSize)
}

func registerMap[Obj comparable](p ReconcilerParams, name string, tbl statedb.RWTable[Obj],
	clone func(Obj) Obj, setStatus func(Obj, reconciler.Status) Obj, getStatus func(Obj) reconciler.Status,
	ops reconciler.Operations[Obj], batchOps reconciler.BatchOperations[Obj], roundSize int) (reconciler.Reconciler[Obj], error) {
	rp := reconciler.Params{Log: p.Log, DB: p.DB, JobGroup: p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log)),
		ModuleID: p.ModuleID, DefaultMetrics: p.DefaultMetrics}
	return reconciler.Register(rp, tbl, clone, setStatus, getStatus, ops, batchOps,
		reconciler.WithName(name),
		reconciler.WithPruning(time.Hour),
		reconciler.WithRefreshing(0, nil),
		reconciler.WithRoundLimits(roundSize, rate.NewLimiter(rate.Inf, 1)),
	)
}
