package tcattach

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// An attachment waits until the pod sources and node addresses are in
// their maps: waitMapsWritten returns when the last row is Done, not before.
func TestWaitMapsWritten(t *testing.T) {
	db := statedb.New()
	sources, err := tables.NewMasqueradeSourceTable(db)
	if err != nil {
		t.Fatal(err)
	}
	addrs, err := tables.NewNodeAddressTable(db)
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(sources, addrs)
	doneSources := sources.RegisterInitializer(wtxn, "test")
	doneAddrs := addrs.RegisterInitializer(wtxn, "test")
	src := &tables.MasqueradeSource{Prefix: netip.MustParsePrefix("10.244.1.0/24"), Status: reconciler.StatusPending()}
	sources.Insert(wtxn, src)
	addrs.Insert(wtxn, &tables.NodeAddress{Addr: netip.MustParseAddr("10.0.0.5"), Status: reconciler.StatusDone()})
	wtxn.Commit()

	wait := waitMapsWritten(db, sources, addrs)
	// Not initialized, a row Pending: it waits (here until the context ends).
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	start := time.Now()
	wait(ctx)
	cancel()
	if time.Since(start) < 50*time.Millisecond {
		t.Fatal("returned while the tables were not initialized and a row was Pending")
	}
	returned := make(chan struct{})
	go func() {
		wait(context.Background())
		close(returned)
	}()
	step := func(what string, f func(statedb.WriteTxn)) {
		select {
		case <-returned:
			t.Fatalf("returned before %s", what)
		default:
		}
		wtxn := db.WriteTxn(sources, addrs)
		f(wtxn)
		wtxn.Commit()
	}
	step("the tables are initialized", func(wtxn statedb.WriteTxn) { doneSources(wtxn); doneAddrs(wtxn) })
	step("the last row is written", func(wtxn statedb.WriteTxn) {
		sources.Insert(wtxn, src.Clone().SetStatus(reconciler.StatusDone()))
	})
	select {
	case <-returned:
	case <-time.After(mapsWrittenWait / 2):
		t.Fatal("did not return once every row was Done")
	}
}

// A row that never gets written (a failing map) holds an attachment back
// for mapsWrittenWait at most.
func TestWaitMapsWrittenBounded(t *testing.T) {
	db := statedb.New()
	sources, _ := tables.NewMasqueradeSourceTable(db)
	addrs, _ := tables.NewNodeAddressTable(db)
	wtxn := db.WriteTxn(sources)
	sources.Insert(wtxn, &tables.MasqueradeSource{Prefix: netip.MustParsePrefix("10.244.1.0/24"), Status: reconciler.StatusError(context.DeadlineExceeded)})
	wtxn.Commit()
	returned := make(chan struct{})
	go func() {
		waitMapsWritten(db, sources, addrs)(context.Background())
		close(returned)
	}()
	select {
	case <-returned:
	case <-time.After(10 * mapsWrittenWait):
		t.Fatal("an unwritten row held the attachment back for good")
	}
}
