package faults

import (
	"context"
	"errors"
	"iter"
	"sync"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
)

// countingOps counts the calls that reach the kernel side.
type countingOps struct {
	mu    sync.Mutex
	calls int
}

func (c *countingOps) call() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls++
	return nil
}

func (c *countingOps) Update(context.Context, statedb.ReadTxn, statedb.Revision, int) error {
	return c.call()
}

func (c *countingOps) Delete(context.Context, statedb.ReadTxn, statedb.Revision, int) error {
	return c.call()
}

func (c *countingOps) Prune(context.Context, statedb.ReadTxn, iter.Seq2[int, statedb.Revision]) error {
	return c.call()
}

func (c *countingOps) UpdateBatch(_ context.Context, _ statedb.ReadTxn, b []reconciler.BatchEntry[int]) {
	for i := range b {
		b[i].Result = c.call()
	}
}

func (c *countingOps) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, b []reconciler.BatchEntry[int]) {
	c.UpdateBatch(ctx, txn, b)
}

func TestWrapNilInjectorIsIdentity(t *testing.T) {
	ops := &countingOps{}
	if got := Wrap[int](nil, NonMasqMaps, ops); got != reconciler.Operations[int](ops) {
		t.Fatalf("Wrap(nil) = %T, want the operations unchanged", got)
	}
	if got := WrapBatch[int](nil, NonMasqMaps, ops); got != reconciler.BatchOperations[int](ops) {
		t.Fatalf("WrapBatch(nil) = %T, want the operations unchanged", got)
	}
	if got := WrapBatch[int](New(), NonMasqMaps, nil); got != nil {
		t.Fatalf("WrapBatch(nil ops) = %T, want nil", got)
	}
}

func TestWrapFailsWhileFailing(t *testing.T) {
	ctx := context.Background()
	inj := New()
	ops := &countingOps{}
	w := Wrap[int](inj, IPRules, ops)
	wb := WrapBatch[int](inj, IPRules, ops)

	if err := w.Update(ctx, nil, 0, 1); err != nil {
		t.Fatalf("Update before Fail: %v", err)
	}

	boom := errors.New("netlink: operation not permitted")
	inj.Fail(IPRules, boom)
	if err := w.Update(ctx, nil, 0, 1); !errors.Is(err, boom) {
		t.Fatalf("Update: %v, want %v", err, boom)
	}
	if err := w.Delete(ctx, nil, 0, 1); !errors.Is(err, boom) {
		t.Fatalf("Delete: %v, want %v", err, boom)
	}
	if err := w.Prune(ctx, nil, nil); !errors.Is(err, boom) {
		t.Fatalf("Prune: %v, want %v", err, boom)
	}
	batch := []reconciler.BatchEntry[int]{{Object: 1}, {Object: 2}}
	wb.UpdateBatch(ctx, nil, batch)
	for _, e := range batch {
		if !errors.Is(e.Result, boom) {
			t.Fatalf("batch entry %d: %v, want %v", e.Object, e.Result, boom)
		}
	}
	if n := inj.Injected(IPRules); n != 5 {
		t.Fatalf("Injected = %d, want 5 (3 calls + a batch of 2)", n)
	}
	if n := inj.Injected(TCAttach); n != 0 {
		t.Fatalf("Injected(other point) = %d, want 0", n)
	}
	if ops.calls != 1 {
		t.Fatalf("%d calls reached the operations while failing, want only the first", ops.calls)
	}

	inj.Clear(IPRules)
	batch = []reconciler.BatchEntry[int]{{Object: 1}}
	wb.DeleteBatch(ctx, nil, batch)
	if batch[0].Result != nil || ops.calls != 2 {
		t.Fatalf("after Clear: result %v, calls %d; want nil, 2", batch[0].Result, ops.calls)
	}
	if n := inj.Injected(IPRules); n != 5 {
		t.Fatalf("Injected after Clear = %d, want 5", n)
	}

	inj.Fail(IPRules, nil)
	if err := w.Update(ctx, nil, 0, 1); !errors.Is(err, ErrInjected) {
		t.Fatalf("Fail(nil): %v, want ErrInjected", err)
	}
}
