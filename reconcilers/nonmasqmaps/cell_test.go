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

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// recordingOps is an in-memory target: it records what the reconciler hands
// over and fails the prefixes it is told to.
type recordingOps struct {
	mu      sync.Mutex
	fail    map[netip.Prefix]error
	updated []*tables.NonMasqCIDR // every row handed to an update, in order
	deleted []*tables.NonMasqCIDR
	// updateBatches and deleteBatches are the sizes of the batches, in order.
	updateBatches, deleteBatches []int
	prunes                       int
	// ops is every write and delete in order: "update P", "delete P".
	ops []string
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
	o.ops = append(o.ops, "update "+row.Prefix.String())
	return o.fail[row.Prefix]
}

func (o *recordingOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, row *tables.NonMasqCIDR) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.deleted = append(o.deleted, row)
	o.ops = append(o.ops, "delete "+row.Prefix.String())
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
	o.updateBatches = append(o.updateBatches, len(batch))
	o.mu.Unlock()
	for i := range batch {
		batch[i].Result = o.Update(ctx, txn, batch[i].Revision, batch[i].Object)
	}
}

func (o *recordingOps) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.NonMasqCIDR]) {
	o.mu.Lock()
	o.deleteBatches = append(o.deleteBatches, len(batch))
	o.mu.Unlock()
	for i := range batch {
		batch[i].Result = o.Delete(ctx, txn, batch[i].Revision, batch[i].Object)
	}
}

func (o *recordingOps) counts() (updated, deleted, prunes int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.updated), len(o.deleted), o.prunes
}

func (o *recordingOps) batches() (updates, deletes []int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]int(nil), o.updateBatches...), append([]int(nil), o.deleteBatches...)
}

// fixture is the nonmasq-maps registration (register, as Cell does it)
// over a new table and an in-memory target, in a hive of its own.
type fixture struct {
	t      testing.TB
	db     *statedb.DB
	table  statedb.RWTable[*tables.NonMasqCIDR]
	config statedb.RWTable[*tables.ConfigStatus]
	ops    *recordingOps
	h      *Handle
	health *cell.SimpleHealth
}

// start registers the reconciler as Cell does, over a new table. initDone,
// when not nil, receives the function that marks the table initialized;
// otherwise the table is initialized from the start.
func start(t testing.TB, initDone *func()) *fixture {
	t.Helper()
	f := &fixture{t: t, db: statedb.New(), ops: newRecordingOps(), h: &Handle{}}
	var err error
	if f.table, err = tables.NewNonMasqCIDRTable(f.db); err != nil {
		t.Fatal(err)
	}
	if f.config, err = tables.NewConfigStatusTable(f.db); err != nil {
		t.Fatal(err)
	}
	if initDone != nil {
		wtxn := f.db.WriteTxn(f.table)
		done := f.table.RegisterInitializer(wtxn, "test")
		wtxn.Commit()
		*initDone = func() {
			wtxn := f.db.WriteTxn(f.table)
			done(wtxn)
			wtxn.Commit()
		}
	}
	h := hive.New(
		cell.Provide(
			func() *statedb.DB { return f.db },
			func() statedb.RWTable[*tables.NonMasqCIDR] { return f.table },
			func() statedb.Table[*tables.ConfigStatus] { return f.config },
		),
		job.Cell,
		cell.SimpleHealthCell,
		cell.Invoke(func(h *cell.SimpleHealth) { f.health = h }),
		cell.Module("nonmasq-maps", "test",
			cell.ProvidePrivate(newJobGroup),
			cell.Provide(
				func() settings.Config { return settings.Config{MaxNonMasqCIDRs: 16384} },
				func() *Handle { return f.h },
				func() reconciler.Operations[*tables.NonMasqCIDR] { return f.ops },
				func() reconciler.BatchOperations[*tables.NonMasqCIDR] { return f.ops },
			),
			cell.Invoke(register)),
	)
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return f
}

func (f *fixture) insert(prefixes ...string) {
	f.t.Helper()
	wtxn := f.db.WriteTxn(f.table)
	for _, p := range prefixes {
		f.table.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(p), Status: reconciler.StatusPending()})
	}
	wtxn.Commit()
}

func (f *fixture) delete(prefixes ...string) {
	f.t.Helper()
	wtxn := f.db.WriteTxn(f.table)
	for _, p := range prefixes {
		f.table.Delete(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(p)})
	}
	wtxn.Commit()
}

func (f *fixture) status(prefix string) string {
	row, _, ok := f.table.Get(f.db.ReadTxn(), tables.NonMasqCIDRByPrefix.Query(netip.MustParsePrefix(prefix)))
	if !ok {
		f.t.Fatalf("no row %s", prefix)
	}
	return tables.StatusString(row.Status)
}

// reconcileHealth is the health of the reconcile job, as `health` shows it.
func (f *fixture) reconcileHealth() (cell.Level, string, error) {
	h := f.health.GetChild("job-reconcile-" + reconcilerName)
	if h == nil {
		return "", "", nil
	}
	h.Lock()
	defer h.Unlock()
	return h.Level, h.Status, h.Error
}

func (f *fixture) setResyncInterval(d time.Duration) {
	wtxn := f.db.WriteTxn(f.config)
	f.config.Insert(wtxn, &tables.ConfigStatus{Path: "/config", ResyncInterval: d})
	wtxn.Commit()
}

// eventually fails the test when cond does not hold within 10 s.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func prefixes(n int, first byte) []string {
	out := make([]string, n)
	for i := range n {
		out[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{first, byte(i >> 8), byte(i), 0}), 24).String()
	}
	return out
}

// A whole new config, 16 384 prefixes replacing 16 384, is one delete
// batch and one update batch, written twice (see below); the generic
// reconciler's default round of 1 000 rows would make 33, each with its
// own status commit.
func TestWholeConfigIsOneBatch(t *testing.T) {
	f := start(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f.insert(prefixes(16384, 20)...)
	if err := f.h.WaitReconciled(ctx); err != nil {
		t.Fatal(err)
	}
	wtxn := f.db.WriteTxn(f.table)
	f.table.DeleteAll(wtxn)
	for _, p := range prefixes(16384, 21) {
		f.table.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(p), Status: reconciler.StatusPending()})
	}
	wtxn.Commit()
	if err := f.h.WaitReconciled(ctx); err != nil {
		t.Fatal(err)
	}
	// The new config is written before the old is deleted (newBeforeOld),
	// and once more by the round's update: against the kernel that second
	// batch costs nothing, the map's cache holds it.
	updates, deletes := f.ops.batches()
	if fmt.Sprint(updates) != "[16384 16384 16384]" || fmt.Sprint(deletes) != "[16384]" {
		t.Errorf("update batches %v, delete batches %v; want one batch of 16384 for the first config, then for the new one one before and one after its one batch of deletes", updates, deletes)
	}
	if got := f.status("21.63.255.0/24"); got != "Done" {
		t.Errorf("last row's status %q, want Done", got)
	}
}

// A config that reshapes a range (10.0.0.0/8 becomes its two /9s) has
// the new prefixes in the map before the old one leaves it: no destination
// of the range is ever without a non-masquerade match. statedb's
// reconciler hands a round's deletes over first; without newBeforeOld the
// /8 would be deleted before the /9s were written.
func TestNewPrefixesWrittenBeforeOldDeleted(t *testing.T) {
	f := start(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f.insert("10.0.0.0/8", "192.168.0.0/16")
	if err := f.h.WaitReconciled(ctx); err != nil {
		t.Fatal(err)
	}
	wtxn := f.db.WriteTxn(f.table)
	f.table.Delete(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix("10.0.0.0/8")})
	for _, p := range []string{"10.0.0.0/9", "10.128.0.0/9"} {
		f.table.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(p), Status: reconciler.StatusPending()})
	}
	wtxn.Commit()
	if err := f.h.WaitReconciled(ctx); err != nil {
		t.Fatal(err)
	}
	f.ops.mu.Lock()
	ops := append([]string(nil), f.ops.ops...)
	f.ops.mu.Unlock()
	at := func(op string) int {
		for i, o := range ops {
			if o == op {
				return i
			}
		}
		t.Fatalf("%q never happened: %v", op, ops)
		return -1
	}
	del := at("delete 10.0.0.0/8")
	for _, p := range []string{"10.0.0.0/9", "10.128.0.0/9"} {
		if at("update "+p) > del {
			t.Errorf("%s written after 10.0.0.0/8 was deleted: %v", p, ops)
		}
	}
	if got := f.status("10.128.0.0/9"); got != "Done" {
		t.Errorf("10.128.0.0/9: status %q, want Done", got)
	}
}

func TestFailedRowsAreRetriedAndReported(t *testing.T) {
	f := start(t, nil)
	bad := netip.MustParsePrefix("198.18.0.0/15")
	f.ops.setFail(bad, errors.New("map write refused"))
	f.insert("10.0.0.0/8", "198.18.0.0/15")
	eventually(t, "the failed row's Error status", func() bool {
		return f.status("198.18.0.0/15") == "Error: map write refused" && f.status("10.0.0.0/8") == "Done"
	})
	eventually(t, "degraded health naming the error", func() bool {
		level, status, err := f.reconcileHealth()
		return level == cell.StatusDegraded && status == "1 error(s)" && err != nil && strings.Contains(err.Error(), "map write refused")
	})
	// WaitUntilReconciled: processed, but a row waits for a retry.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rev, low, err := f.h.r.WaitUntilReconciled(ctx, f.table.Revision(f.db.ReadTxn()))
	if err != nil || low == 0 || low > rev {
		t.Fatalf("WaitUntilReconciled = %d, low watermark %d, %v; want a low watermark at the failed row", rev, low, err)
	}
	// Backoff: several attempts over the next second, not one per round.
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
		level, status, _ := f.reconcileHealth()
		return f.status("198.18.0.0/15") == "Done" && level == cell.StatusOK && status == "OK, 2 object(s)"
	})
}

func TestFailedDeletesAreRetried(t *testing.T) {
	f := start(t, nil)
	f.insert("10.0.0.0/8")
	eventually(t, "write", func() bool { return f.status("10.0.0.0/8") == "Done" })
	p := netip.MustParsePrefix("10.0.0.0/8")
	f.ops.setFail(p, errors.New("map delete refused"))
	f.delete("10.0.0.0/8")
	eventually(t, "degraded health", func() bool {
		level, _, err := f.reconcileHealth()
		return level == cell.StatusDegraded && err != nil && strings.Contains(err.Error(), "map delete refused")
	})
	f.ops.setFail(p, nil)
	eventually(t, "the delete retried and health OK", func() bool {
		level, _, _ := f.reconcileHealth()
		_, deleted, _ := f.ops.counts()
		return level == cell.StatusOK && deleted >= 2
	})
}

// The maps are compared with the table once it is initialized (a restart
// leaves entries the config no longer lists), never before, and on request
// (maps/resync).
func TestPrunesWhenInitializedAndOnRequest(t *testing.T) {
	var initDone func()
	f := start(t, &initDone)
	f.insert("10.0.0.0/8")
	f.h.r.Prune() // before initialization: waits for it
	eventually(t, "write", func() bool { return f.status("10.0.0.0/8") == "Done" })
	time.Sleep(50 * time.Millisecond)
	if _, _, prunes := f.ops.counts(); prunes != 0 {
		t.Fatalf("%d prunes before the table was initialized, want 0", prunes)
	}
	initDone()
	eventually(t, "a prune once initialized", func() bool { _, _, n := f.ops.counts(); return n >= 1 })
	time.Sleep(50 * time.Millisecond)
	_, _, before := f.ops.counts()
	f.h.r.Prune()
	eventually(t, "a prune on request", func() bool { _, _, n := f.ops.counts(); return n == before+1 })
}

// The full comparison runs every resyncInterval of the applied config, and
// a new interval takes effect at once.
func TestResyncIntervalDrivesPrunes(t *testing.T) {
	f := start(t, nil)
	eventually(t, "the prune at initialization", func() bool { _, _, n := f.ops.counts(); return n >= 1 })
	f.setResyncInterval(time.Hour)
	time.Sleep(100 * time.Millisecond)
	_, _, before := f.ops.counts()
	f.setResyncInterval(10 * time.Millisecond)
	eventually(t, "three prunes from the resync interval", func() bool { _, _, n := f.ops.counts(); return n >= before+3 })
}

// BenchmarkReconcileRound replaces all n rows of the table in one
// transaction and waits until the reconciler has written them and committed
// their statuses, against an in-memory target: the cost of the reconciler
// as this package registers it.
func BenchmarkReconcileRound(b *testing.B) {
	for _, n := range []int{1000, 16384} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			f := start(b, nil)
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				wtxn := f.db.WriteTxn(f.table)
				f.table.DeleteAll(wtxn)
				for j := range n {
					addr := netip.AddrFrom4([4]byte{byte(20 + i%8), byte(j >> 8), byte(j), 0})
					f.table.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.PrefixFrom(addr, 24), Status: reconciler.StatusPending()})
				}
				rev := f.table.Revision(wtxn)
				wtxn.Commit()
				if _, _, err := f.h.r.WaitUntilReconciled(context.Background(), rev); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// The early write takes a family's rows only when they all fit beside the
// old ones: a full map keeps the old order (deletes first) for that family
// instead of failing the early write and making room by evicting; the
// other family, with room, is written early; before the maps are built
// the room is not known, and every row is written early.
func TestNewBeforeOldOnlyWhatFits(t *testing.T) {
	db := statedb.New()
	tbl, err := tables.NewNonMasqCIDRTable(db)
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(tbl)
	for _, p := range []string{"10.0.0.0/9", "10.128.0.0/9", "10.0.0.0/8", "fd00::/9", "fd80::/9"} {
		st := reconciler.StatusPending()
		if p == "10.0.0.0/8" {
			st = reconciler.StatusDone()
		}
		tbl.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(p), Status: st})
	}
	wtxn.Commit()
	for _, tc := range []struct {
		name   string
		free   map[tables.Family]int // absent: not known
		expect string
	}{
		{"room for both", map[tables.Family]int{tables.IPv4: 2, tables.IPv6: 2}, "10.0.0.0/9 10.128.0.0/9 fd00::/9 fd80::/9"},
		{"ipv4 full", map[tables.Family]int{tables.IPv4: 1, tables.IPv6: 5}, "fd00::/9 fd80::/9"},
		{"ipv6 full", map[tables.Family]int{tables.IPv4: 2, tables.IPv6: 0}, "10.0.0.0/9 10.128.0.0/9"},
		{"not built yet", nil, "10.0.0.0/9 10.128.0.0/9 fd00::/9 fd80::/9"},
	} {
		o := newBeforeOld{tbl: tbl, free: func(f tables.Family) (int, bool) {
			n, ok := tc.free[f]
			return n, ok
		}}
		var got []string
		for _, e := range o.pendingThatFit(db.ReadTxn()) {
			got = append(got, e.Object.Prefix.String())
		}
		if s := strings.Join(got, " "); s != tc.expect {
			t.Errorf("%s: written early %q, want %q", tc.name, s, tc.expect)
		}
	}
}
