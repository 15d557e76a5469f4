package nonmasqmaps

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/ipmasq/ipmasq/tables"
)

// recordingOps is an in-memory target: it records what the reconciler hands
// over and fails the prefixes it is told to.
type recordingOps struct {
	mu      sync.Mutex
	fail    map[netip.Prefix]error
	updated []*tables.NonMasqCIDR // every row handed to an update, in order
	deleted []*tables.NonMasqCIDR
	prunes  int
	// duringUpdate, when set, runs inside the next UpdateBatch (once).
	duringUpdate func()
}

func newRecordingOps() *recordingOps { return &recordingOps{fail: map[netip.Prefix]error{}} }

func (o *recordingOps) setFail(p netip.Prefix, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if err == nil {
		delete(o.fail, p)
	} else {
		o.fail[p] = err
	}
}

func (o *recordingOps) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, row *tables.NonMasqCIDR) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.updated = append(o.updated, row)
	return o.fail[row.Prefix]
}

func (o *recordingOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, row *tables.NonMasqCIDR) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.deleted = append(o.deleted, row)
	return o.fail[row.Prefix]
}

func (o *recordingOps) Prune(context.Context, statedb.ReadTxn, iter.Seq2[*tables.NonMasqCIDR, statedb.Revision]) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.prunes++
	return nil
}

func (o *recordingOps) UpdateBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.NonMasqCIDR]) {
	o.mu.Lock()
	during := o.duringUpdate
	o.duringUpdate = nil
	o.mu.Unlock()
	if during != nil {
		during()
	}
	for i := range batch {
		batch[i].Result = o.Update(ctx, txn, batch[i].Revision, batch[i].Object)
	}
}

func (o *recordingOps) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.NonMasqCIDR]) {
	for i := range batch {
		batch[i].Result = o.Delete(ctx, txn, batch[i].Revision, batch[i].Object)
	}
}

func (o *recordingOps) counts() (updated, deleted, prunes int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.updated), len(o.deleted), o.prunes
}

// reconcilerFixture is a nonmasq-cidrs table with a running mapReconciler.
type reconcilerFixture struct {
	t      testing.TB
	db     *statedb.DB
	table  statedb.RWTable[*tables.NonMasqCIDR]
	ops    *recordingOps
	r      *mapReconciler
	health *cell.SimpleHealth
}

// startReconciler runs a reconciler over a new table. initDone, when not
// nil, receives the function that marks the table initialized; otherwise
// the table is initialized from the start.
func startReconciler(t testing.TB, initDone *func()) *reconcilerFixture {
	t.Helper()
	db := statedb.New()
	table, err := tables.NewNonMasqCIDRTable(db)
	if err != nil {
		t.Fatal(err)
	}
	if initDone != nil {
		wtxn := db.WriteTxn(table)
		done := table.RegisterInitializer(wtxn, "test")
		wtxn.Commit()
		*initDone = func() {
			wtxn := db.WriteTxn(table)
			done(wtxn)
			wtxn.Commit()
		}
	}
	f := &reconcilerFixture{t: t, db: db, table: table, ops: newRecordingOps()}
	f.r = newMapReconciler(slog.New(slog.DiscardHandler), db, table, f.ops, f.ops,
		reconciler.NewUnpublishedExpVarMetrics(), cell.FullModuleID{"test"})
	health, simple := cell.NewSimpleHealth()
	f.health = simple
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		f.r.run(ctx, health)
	}()
	t.Cleanup(func() {
		cancel()
		<-stopped
	})
	return f
}

// insert adds Pending rows in one transaction and returns them.
func (f *reconcilerFixture) insert(prefixes ...string) []*tables.NonMasqCIDR {
	f.t.Helper()
	wtxn := f.db.WriteTxn(f.table)
	var rows []*tables.NonMasqCIDR
	for _, p := range prefixes {
		row := &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(p), Status: reconciler.StatusPending()}
		f.table.Insert(wtxn, row)
		rows = append(rows, row)
	}
	wtxn.Commit()
	return rows
}

func (f *reconcilerFixture) delete(prefixes ...string) {
	f.t.Helper()
	wtxn := f.db.WriteTxn(f.table)
	for _, p := range prefixes {
		f.table.Delete(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(p)})
	}
	wtxn.Commit()
}

func (f *reconcilerFixture) row(prefix string) *tables.NonMasqCIDR {
	row, _, ok := f.table.Get(f.db.ReadTxn(), tables.NonMasqCIDRByPrefix.Query(netip.MustParsePrefix(prefix)))
	if !ok {
		f.t.Fatalf("no row %s", prefix)
	}
	return row
}

func (f *reconcilerFixture) status(prefix string) string {
	return tables.StatusString(f.row(prefix).Status)
}

func (f *reconcilerFixture) healthNow() (cell.Level, string, error) {
	f.health.Lock()
	defer f.health.Unlock()
	return f.health.Level, f.health.Status, f.health.Error
}

// eventually fails the test when cond does not hold within 10 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func TestReconcilerHandsTheTableRowsOver(t *testing.T) {
	f := startReconciler(t, nil)
	inserted := f.insert("10.0.0.0/8", "192.168.0.0/16", "fd00::/8")
	eventually(t, "every row Done", func() bool {
		return f.status("10.0.0.0/8") == "Done" && f.status("192.168.0.0/16") == "Done" && f.status("fd00::/8") == "Done"
	})
	// The operations got the inserted rows themselves, not a clone of each
	// (which statedb's generic reconciler makes), in revision order.
	f.ops.mu.Lock()
	defer f.ops.mu.Unlock()
	if len(f.ops.updated) != 3 {
		t.Fatalf("ops got %d rows, want 3 (one write each)", len(f.ops.updated))
	}
	for i, got := range f.ops.updated {
		if got != inserted[i] {
			t.Errorf("row %d handed over is a copy of %s, want the table's row", i, inserted[i].Prefix)
		}
	}
	// Rows are immutable: the Done status is on new rows.
	for _, row := range inserted {
		if row.Status.Kind != reconciler.StatusKindPending {
			t.Errorf("the status commit changed the inserted row %s in place", row.Prefix)
		}
		if f.row(row.Prefix.String()) == row {
			t.Errorf("%s: the table still holds the Pending row", row.Prefix)
		}
	}
}

func TestReconcilerRetriesFailedRowsAndReportsThem(t *testing.T) {
	f := startReconciler(t, nil)
	bad := netip.MustParsePrefix("198.18.0.0/15")
	f.ops.setFail(bad, errors.New("map write refused"))
	f.insert("10.0.0.0/8", "198.18.0.0/15")
	eventually(t, "the failed row's Error status", func() bool {
		return f.status("198.18.0.0/15") == "Error: map write refused" && f.status("10.0.0.0/8") == "Done"
	})
	eventually(t, "degraded health naming the error", func() bool {
		level, status, err := f.healthNow()
		return level == cell.StatusDegraded && status == "1 error(s)" && err != nil && strings.Contains(err.Error(), "map write refused")
	})
	// WaitUntilReconciled: processed, but a row waits for a retry.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rev, low, err := f.r.WaitUntilReconciled(ctx, f.table.Revision(f.db.ReadTxn()))
	if err != nil || low == 0 || low > rev {
		t.Fatalf("WaitUntilReconciled = %d, low watermark %d, %v; want a low watermark at the failed row", rev, low, err)
	}
	// Backoff: several attempts over the next half second, not one per round.
	eventually(t, "retries", func() bool {
		n := 0
		f.ops.mu.Lock()
		for _, row := range f.ops.updated {
			if row.Prefix == bad {
				n++
			}
		}
		f.ops.mu.Unlock()
		return n >= 3
	})
	f.ops.setFail(bad, nil)
	eventually(t, "the retried row Done and health OK", func() bool {
		level, status, _ := f.healthNow()
		return f.status("198.18.0.0/15") == "Done" && level == cell.StatusOK && status == "OK, 2 object(s)"
	})
	if _, low, _ := f.r.WaitUntilReconciled(ctx, f.table.Revision(f.db.ReadTxn())); low != 0 {
		t.Errorf("low watermark %d after the retry succeeded, want 0", low)
	}
}

func TestReconcilerKeepsARowChangedDuringItsWrite(t *testing.T) {
	f := startReconciler(t, nil)
	f.insert("10.0.0.0/8")
	eventually(t, "first write", func() bool { return f.status("10.0.0.0/8") == "Done" })

	// While the reconciler writes version 2, the loader inserts version 3.
	f.ops.mu.Lock()
	f.ops.duringUpdate = func() {
		wtxn := f.db.WriteTxn(f.table)
		f.table.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Action: tables.ActionMasquerade, Status: reconciler.StatusPending()})
		wtxn.Commit()
	}
	f.ops.mu.Unlock()
	f.insert("10.0.0.0/8") // version 2: no-masquerade, Pending
	eventually(t, "version 3 written and Done", func() bool {
		row := f.row("10.0.0.0/8")
		return row.Action == tables.ActionMasquerade && tables.StatusString(row.Status) == "Done"
	})
	f.ops.mu.Lock()
	defer f.ops.mu.Unlock()
	last := f.ops.updated[len(f.ops.updated)-1]
	if last.Action != tables.ActionMasquerade {
		t.Errorf("last write had action %s, want version 3's masquerade", last.Action)
	}
}

func TestReconcilerRetriesFailedDeletes(t *testing.T) {
	f := startReconciler(t, nil)
	f.insert("10.0.0.0/8")
	eventually(t, "write", func() bool { return f.status("10.0.0.0/8") == "Done" })
	p := netip.MustParsePrefix("10.0.0.0/8")
	f.ops.setFail(p, errors.New("map delete refused"))
	f.delete("10.0.0.0/8")
	eventually(t, "degraded health", func() bool {
		level, _, err := f.healthNow()
		return level == cell.StatusDegraded && err != nil && strings.Contains(err.Error(), "map delete refused")
	})
	f.ops.setFail(p, nil)
	eventually(t, "the delete retried and health OK", func() bool {
		level, _, _ := f.healthNow()
		_, deleted, _ := f.ops.counts()
		return level == cell.StatusOK && deleted >= 2
	})
}

func TestReconcilerPrunesWhenInitializedAndOnRequest(t *testing.T) {
	var initDone func()
	f := startReconciler(t, &initDone)
	f.insert("10.0.0.0/8")
	f.r.Prune() // before initialization: waits for it
	eventually(t, "write", func() bool { return f.status("10.0.0.0/8") == "Done" })
	time.Sleep(50 * time.Millisecond)
	if _, _, prunes := f.ops.counts(); prunes != 0 {
		t.Fatalf("%d prunes before the table was initialized, want 0", prunes)
	}
	initDone()
	eventually(t, "a prune once initialized", func() bool { _, _, n := f.ops.counts(); return n >= 1 })
	time.Sleep(50 * time.Millisecond)
	_, _, before := f.ops.counts()
	if before > 2 {
		t.Fatalf("%d prunes at initialization, want at most the two asked for", before)
	}
	f.r.Prune()
	eventually(t, "a prune on request", func() bool { _, _, n := f.ops.counts(); return n == before+1 })
}

func TestReconcilerHealthNamesTenErrors(t *testing.T) {
	f := startReconciler(t, nil)
	var prefixes []string
	for i := range 12 {
		p := fmt.Sprintf("10.%d.0.0/16", i)
		prefixes = append(prefixes, p)
		f.ops.setFail(netip.MustParsePrefix(p), fmt.Errorf("refused %s", p))
	}
	f.insert(prefixes...)
	eventually(t, "12 errors", func() bool {
		level, status, err := f.healthNow()
		return level == cell.StatusDegraded && status == "12 error(s)" && err != nil
	})
	_, _, err := f.healthNow()
	msg := err.Error()
	if !strings.Contains(msg, "refused 10.0.0.0/16") || !strings.Contains(msg, "2 further errors omitted") || strings.Contains(msg, "refused 10.11.0.0/16") {
		t.Errorf("health error = %q, want the first ten in prefix order and the rest counted", msg)
	}
}

// BenchmarkReconcileRound replaces all n rows of the table in one
// transaction and waits until the reconciler has written them and committed
// their statuses, against an in-memory target: the cost of the reconciler
// itself. "generic" is statedb's reconciler configured as this cell used
// it (one round for the whole table), measured in the same run.
func BenchmarkReconcileRound(b *testing.B) {
	for _, n := range []int{1000, 16384} {
		b.Run(fmt.Sprintf("n=%d/lean", n), func(b *testing.B) {
			f := startReconciler(b, nil)
			benchmarkRound(b, n, f.db, f.table, f.r)
		})
		b.Run(fmt.Sprintf("n=%d/generic", n), func(b *testing.B) {
			db := statedb.New()
			table, err := tables.NewNonMasqCIDRTable(db)
			if err != nil {
				b.Fatal(err)
			}
			ops := newRecordingOps()
			var r reconciler.Reconciler[*tables.NonMasqCIDR]
			h := hive.New(
				cell.Provide(func() *statedb.DB { return db }),
				job.Cell,
				cell.SimpleHealthCell,
				cell.Module("test", "test",
					cell.ProvidePrivate(func(reg job.Registry, h cell.Health) job.Group { return reg.NewGroup(h) }),
					cell.Invoke(func(p reconciler.Params) (err error) {
						r, err = reconciler.Register(p, table,
							(*tables.NonMasqCIDR).Clone, (*tables.NonMasqCIDR).SetStatus, (*tables.NonMasqCIDR).GetStatus,
							ops, ops,
							reconciler.WithoutPruning(), reconciler.WithRefreshing(0, nil),
							reconciler.WithRoundLimits(2*n+1024, rate.NewLimiter(rate.Inf, 1)))
						return err
					})),
			)
			log := slog.New(slog.DiscardHandler)
			if err := h.Start(log, context.Background()); err != nil {
				b.Fatal(err)
			}
			defer h.Stop(log, context.Background())
			benchmarkRound(b, n, db, table, r)
		})
	}
}

func benchmarkRound(b *testing.B, n int, db *statedb.DB, table statedb.RWTable[*tables.NonMasqCIDR], r reconciler.Reconciler[*tables.NonMasqCIDR]) {
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		wtxn := db.WriteTxn(table)
		table.DeleteAll(wtxn)
		for j := range n {
			addr := netip.AddrFrom4([4]byte{byte(20 + i%8), byte(j >> 8), byte(j), 0})
			table.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.PrefixFrom(addr, 24), Status: reconciler.StatusPending()})
		}
		rev := table.Revision(wtxn)
		wtxn.Commit()
		if _, _, err := r.WaitUntilReconciled(context.Background(), rev); err != nil {
			b.Fatal(err)
		}
	}
}
