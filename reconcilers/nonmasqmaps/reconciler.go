package nonmasqmaps

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"math"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// reconcilerName names the reconciler in its metrics.
const reconcilerName = "nonmasq-maps"

// Retry backoff of a failed row: twice the last wait from retryMin (the
// first retry after 2×retryMin), never more than retryMax. The same as
// statedb's reconciler defaults.
const (
	retryMin = 100 * time.Millisecond
	retryMax = time.Minute
	// maxHealthErrors caps the errors joined into the degraded health
	// message, so that a full map does not build a message of 16 384 lines.
	maxHealthErrors = 10
)

// mapReconciler writes the rows of nonmasq-cidrs into the maps. It keeps the
// contract of statedb's generic reconciler for this table (a Done or Error
// status on each row, failed rows retried with backoff, a prune when the
// table is initialized and on request, WaitUntilReconciled, the
// reconciler.Metrics, the health of a "reconcile" job), but a round is one
// pass over the changed rows: the rows go to the batch operations as they
// are (the map operations do not modify them, so no clone per row), and
// their statuses are committed in one transaction as copies taken from one
// block. The generic reconciler's clones, its growing batches and its map
// of results were a third of the CPU and of the bytes allocated from a
// 16 384-prefix config to the maps.
type mapReconciler struct {
	log      *slog.Logger
	db       *statedb.DB
	table    statedb.RWTable[*tables.NonMasqCIDR]
	ops      reconciler.Operations[*tables.NonMasqCIDR]
	batchOps reconciler.BatchOperations[*tables.NonMasqCIDR]
	metrics  reconciler.Metrics
	moduleID cell.FullModuleID

	pruneRequest chan struct{}
	progress     progress

	// Used by the reconcile loop only.
	retries map[netip.Prefix]*retry
	updates []reconciler.BatchEntry[*tables.NonMasqCIDR]
	deletes []reconciler.BatchEntry[*tables.NonMasqCIDR]
}

var _ reconciler.Reconciler[*tables.NonMasqCIDR] = (*mapReconciler)(nil)

// newMapReconciler returns a reconciler of table into ops; its run method
// is the job that does the work.
func newMapReconciler(log *slog.Logger, db *statedb.DB, table statedb.RWTable[*tables.NonMasqCIDR],
	ops reconciler.Operations[*tables.NonMasqCIDR], batchOps reconciler.BatchOperations[*tables.NonMasqCIDR],
	metrics reconciler.Metrics, moduleID cell.FullModuleID) *mapReconciler {
	return &mapReconciler{
		log: log, db: db, table: table, ops: ops, batchOps: batchOps,
		metrics: metrics, moduleID: moduleID,
		pruneRequest: make(chan struct{}, 1),
		retries:      map[netip.Prefix]*retry{},
	}
}

// retry is a row whose last write or delete failed.
type retry struct {
	row      *tables.NonMasqCIDR
	rev      statedb.Revision // the row's revision now (after its Error status)
	origRev  statedb.Revision // the revision that first failed, for WaitUntilReconciled
	delete   bool
	attempts int
	at       time.Time
	err      error
}

// Prune asks for a comparison of the maps with the table (stale entries
// deleted, changed ones repaired) in the next round. Requests made before
// the table is initialized wait for it.
func (r *mapReconciler) Prune() {
	select {
	case r.pruneRequest <- struct{}{}:
	default:
	}
}

// WaitUntilReconciled waits until every change of the table up to
// untilRevision has been processed once. It also returns the lowest
// revision of a row still waiting for a retry (0: none).
func (r *mapReconciler) WaitUntilReconciled(ctx context.Context, untilRevision statedb.Revision) (statedb.Revision, statedb.Revision, error) {
	return r.progress.wait(ctx, untilRevision)
}

// run is the reconcile job: one round per batch of table changes, due
// retries or prune request.
func (r *mapReconciler) run(ctx context.Context, health cell.Health) error {
	wtxn := r.db.WriteTxn(r.table)
	changes, err := r.table.Changes(wtxn)
	txn := wtxn.Commit()
	if err != nil {
		return fmt.Errorf("watch nonmasq-cidrs for changes: %w", err)
	}
	defer changes.Close()

	// The first prune comes when the table is initialized (initWatch is
	// closed then, or already): the maps may hold entries from before a
	// restart that the config no longer lists.
	_, initWatch := r.table.Initialized(txn)
	prune := false // until initWatch fires (then nil), prune requests wait
	var tableWatch <-chan struct{} = closedChan
	retryTimer := time.NewTimer(time.Hour)
	retryTimer.Stop()
	defer retryTimer.Stop()

	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tableWatch:
		case <-retryTimer.C:
		case <-initWatch:
			initWatch, prune = nil, true
		case <-r.pruneRequest:
			prune = true
		}

		txn = r.db.ReadTxn()
		var seq iter.Seq2[statedb.Change[*tables.NonMasqCIDR], statedb.Revision]
		seq, tableWatch = changes.Next(txn)
		lastRev := r.collect(seq)
		newErrors := r.write(ctx, txn)
		newErrors += r.retryDue(ctx, txn)
		waiting := r.summarizeRetries()
		r.progress.update(lastRev, waiting.lowRev)

		errs, total := waiting.firstErrs, waiting.count
		if prune && initWatch == nil {
			if err := r.prune(ctx, txn); err != nil {
				errs, total = append(errs, err), total+1
			}
			prune = false
		}
		r.metrics.ReconciliationErrors(r.moduleID, reconcilerName, newErrors, total)
		if total == 0 {
			health.OK(fmt.Sprintf("OK, %d object(s)", r.table.NumObjects(txn)))
		} else {
			health.Degraded(fmt.Sprintf("%d error(s)", total), joinErrors(errs, total))
		}
		if waiting.count > 0 {
			retryTimer.Reset(time.Until(waiting.next))
		} else {
			retryTimer.Stop()
		}
	}
}

// collect sorts the changes into the delete and update batches: deleted
// rows, and rows still waiting for their first write (Pending). A row that
// changed drops its retry: the new version is written instead. It returns
// the revision of the last change seen.
func (r *mapReconciler) collect(changes iter.Seq2[statedb.Change[*tables.NonMasqCIDR], statedb.Revision]) (lastRev statedb.Revision) {
	for change, rev := range changes {
		lastRev = rev
		row := change.Object
		if !change.Deleted && !row.Status.IsPendingOrRefreshing() {
			continue // a status commit, ours or a retry's
		}
		delete(r.retries, row.Prefix)
		entry := reconciler.BatchEntry[*tables.NonMasqCIDR]{Object: row, Revision: rev}
		if change.Deleted {
			r.deletes = append(r.deletes, entry)
		} else {
			r.updates = append(r.updates, entry)
		}
	}
	return lastRev
}

// write runs the delete batch (first: it makes room), then the update
// batch, and commits the updated rows' statuses. It returns the number of
// rows that failed.
func (r *mapReconciler) write(ctx context.Context, txn statedb.ReadTxn) (failed int) {
	if len(r.deletes) > 0 {
		start := time.Now()
		r.batchOps.DeleteBatch(ctx, txn, r.deletes)
		r.metrics.ReconciliationDuration(r.moduleID, reconcilerName, reconciler.OpDelete, time.Since(start))
		for _, e := range r.deletes {
			if e.Result != nil {
				r.addRetry(e.Object, e.Revision, e.Revision, true, e.Result)
				failed++
			}
		}
	}
	if len(r.updates) > 0 {
		start := time.Now()
		r.batchOps.UpdateBatch(ctx, txn, r.updates)
		r.metrics.ReconciliationDuration(r.moduleID, reconcilerName, reconciler.OpUpdate, time.Since(start))
		failed += r.commitStatus(r.updates, nil)
	}
	r.deletes, r.updates = reuse(r.deletes), reuse(r.updates)
	return failed
}

// keepBatch is the largest batch array kept for the next round: small
// changes reuse it, the array of a whole new config is left to the
// collector rather than held by an idle agent.
const keepBatch = 1024

// reuse empties a batch for the next round, dropping its rows.
func reuse(batch []reconciler.BatchEntry[*tables.NonMasqCIDR]) []reconciler.BatchEntry[*tables.NonMasqCIDR] {
	if cap(batch) > keepBatch {
		return nil
	}
	clear(batch)
	return batch[:0]
}

// commitStatus records the outcome of each entry as its row's status in
// one transaction: Done, or Error and a retry with backoff. A row that
// changed since it was read is left alone: the next round writes the new
// version. retried holds the retry each entry came from (nil: first
// attempts). It returns the number of failed rows.
func (r *mapReconciler) commitStatus(entries []reconciler.BatchEntry[*tables.NonMasqCIDR], retried []*retry) (failed int) {
	// The new rows come from one block: one allocation per round, not one
	// per row, and the loader's rows become garbage together.
	block := make([]tables.NonMasqCIDR, len(entries))
	done := reconciler.StatusDone()
	wtxn := r.db.WriteTxn(r.table)
	for i := range entries {
		e := &entries[i]
		row := &block[i]
		*row = *e.Object
		row.Status = done
		if e.Result != nil {
			row.Status = reconciler.StatusError(e.Result)
			failed++
		}
		if _, _, err := r.table.CompareAndSwap(wtxn, e.Revision, row); err != nil {
			continue // changed or deleted meanwhile
		}
		switch {
		case e.Result == nil:
			delete(r.retries, row.Prefix)
		case retried != nil:
			r.addRetry(row, r.table.Revision(wtxn), retried[i].origRev, false, e.Result)
		default:
			r.addRetry(row, r.table.Revision(wtxn), e.Revision, false, e.Result)
		}
	}
	wtxn.Commit()
	return failed
}

// addRetry queues row for another attempt after its backoff.
func (r *mapReconciler) addRetry(row *tables.NonMasqCIDR, rev, origRev statedb.Revision, del bool, err error) {
	it := r.retries[row.Prefix]
	if it == nil {
		it = &retry{}
		r.retries[row.Prefix] = it
	}
	it.row, it.rev, it.origRev, it.delete, it.err = row, rev, origRev, del, err
	it.attempts++
	it.at = time.Now().Add(backoff(it.attempts))
}

func backoff(attempt int) time.Duration {
	d := float64(retryMin) * math.Pow(2, float64(attempt))
	if d > float64(retryMax) {
		return retryMax
	}
	return time.Duration(d)
}

// retryDue retries, one row at a time, the rows whose backoff is over. It
// returns the number that failed again.
func (r *mapReconciler) retryDue(ctx context.Context, txn statedb.ReadTxn) (failed int) {
	now := time.Now()
	var (
		updates []reconciler.BatchEntry[*tables.NonMasqCIDR]
		from    []*retry
	)
	for prefix, it := range r.retries {
		if it.at.After(now) {
			continue
		}
		if it.delete {
			start := time.Now()
			err := r.ops.Delete(ctx, txn, it.rev, it.row)
			r.metrics.ReconciliationDuration(r.moduleID, reconcilerName, reconciler.OpDelete, time.Since(start))
			if err != nil {
				r.addRetry(it.row, it.rev, it.origRev, true, err)
				failed++
			} else {
				delete(r.retries, prefix)
			}
			continue
		}
		start := time.Now()
		err := r.ops.Update(ctx, txn, it.rev, it.row)
		r.metrics.ReconciliationDuration(r.moduleID, reconcilerName, reconciler.OpUpdate, time.Since(start))
		updates = append(updates, reconciler.BatchEntry[*tables.NonMasqCIDR]{Object: it.row, Revision: it.rev, Result: err})
		from = append(from, it)
	}
	if len(updates) > 0 {
		failed += r.commitStatus(updates, from)
	}
	return failed
}

// retrySummary is what a round reports of the rows waiting for a retry.
type retrySummary struct {
	count  int
	lowRev statedb.Revision // the lowest revision still waiting (WaitUntilReconciled), 0: none
	next   time.Time        // when the earliest retry is due
	// firstErrs are the last errors of the first maxHealthErrors rows in
	// prefix order, so that the health message is stable.
	firstErrs []error
}

// summarizeRetries walks the rows waiting for a retry once. Only the
// first maxHealthErrors are ordered: with a full map or a disabled family
// thousands of rows can wait, and the health message names ten.
func (r *mapReconciler) summarizeRetries() retrySummary {
	sum := retrySummary{count: len(r.retries)}
	var first []*retry // sorted by prefix, at most maxHealthErrors
	for _, it := range r.retries {
		if sum.lowRev == 0 || it.origRev < sum.lowRev {
			sum.lowRev = it.origRev
		}
		if sum.next.IsZero() || it.at.Before(sum.next) {
			sum.next = it.at
		}
		i, _ := slices.BinarySearchFunc(first, it.row.Prefix, func(f *retry, p netip.Prefix) int { return f.row.Prefix.Compare(p) })
		if i < maxHealthErrors {
			first = slices.Insert(first, i, it)
			first = first[:min(len(first), maxHealthErrors)]
		}
	}
	for _, it := range first {
		sum.firstErrs = append(sum.firstErrs, it.err)
	}
	return sum
}

// joinErrors joins the first maxHealthErrors of errs and counts the rest
// of total.
func joinErrors(errs []error, total int) error {
	if len(errs) > maxHealthErrors {
		errs = errs[:maxHealthErrors]
	}
	if total > len(errs) {
		errs = append(slices.Clone(errs), fmt.Errorf("%d further errors omitted", total-len(errs)))
	}
	return errors.Join(errs...)
}

// prune compares the maps with every row of the table.
func (r *mapReconciler) prune(ctx context.Context, txn statedb.ReadTxn) error {
	start := time.Now()
	err := r.ops.Prune(ctx, txn, r.table.All(txn))
	if err != nil {
		r.log.Warn("Non-masquerade maps: prune failed", "error", err)
		err = fmt.Errorf("prune: %w", err)
	}
	r.metrics.PruneDuration(r.moduleID, reconcilerName, time.Since(start))
	r.metrics.PruneError(r.moduleID, reconcilerName, err)
	return err
}

var closedChan = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// progress is how far the reconciler has got: the last revision processed
// and the lowest one still waiting for a retry.
type progress struct {
	mu       sync.Mutex
	revision statedb.Revision
	retryLow statedb.Revision
	changed  chan struct{}
}

func (p *progress) update(rev, retryLow statedb.Revision) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if rev <= p.revision && retryLow == p.retryLow {
		return
	}
	p.revision = max(p.revision, rev)
	p.retryLow = retryLow
	if p.changed != nil {
		close(p.changed)
		p.changed = nil
	}
}

func (p *progress) wait(ctx context.Context, rev statedb.Revision) (statedb.Revision, statedb.Revision, error) {
	for {
		p.mu.Lock()
		current, low := p.revision, p.retryLow
		if p.changed == nil {
			p.changed = make(chan struct{})
		}
		changed := p.changed
		p.mu.Unlock()
		if current >= rev {
			return current, low, nil
		}
		select {
		case <-ctx.Done():
			return current, low, ctx.Err()
		case <-changed:
		}
	}
}
