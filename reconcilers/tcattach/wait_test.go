package tcattach

import (
	"context"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// waitFixture holds the four tables an attachment waits for, each with an
// initializer.
type waitFixture struct {
	db          *statedb.DB
	sources     statedb.RWTable[*tables.MasqueradeSource]
	addrs       statedb.RWTable[*tables.NodeAddress]
	ruleSources statedb.RWTable[*tables.MasqueradeRuleSource]
	nonMasq     statedb.RWTable[*tables.NonMasqCIDR]
}

func newWaitFixture(t *testing.T) *waitFixture {
	t.Helper()
	f := &waitFixture{db: statedb.New()}
	var err error
	must := func(e error) {
		if e != nil {
			t.Fatal(e)
		}
	}
	f.sources, err = tables.NewMasqueradeSourceTable(f.db)
	must(err)
	f.addrs, err = tables.NewNodeAddressTable(f.db)
	must(err)
	f.ruleSources, err = tables.NewMasqueradeRuleSourceTable(f.db)
	must(err)
	f.nonMasq, err = tables.NewNonMasqCIDRTable(f.db)
	must(err)
	return f
}

func (f *waitFixture) wait() func(context.Context) {
	return waitMapsWritten(f.db, slog.New(slog.DiscardHandler),
		mapsWrittenTables{Sources: f.sources, NodeAddrs: f.addrs, RuleSources: f.ruleSources, NonMasq: f.nonMasq})
}

func (f *waitFixture) write(fn func(statedb.WriteTxn)) {
	wtxn := f.db.WriteTxn(f.sources, f.addrs, f.ruleSources, f.nonMasq)
	fn(wtxn)
	wtxn.Commit()
}

// An attachment waits until the masquerade sources, node addresses, rule
// sources and non-masquerade prefixes are in their maps: waitMapsWritten
// returns when the last table is initialized and its last row Done, not
// before. Without the non-masquerade prefixes, a device attached at start
// masquerades traffic bound for 10.0.0.0/8 until they are written.
func TestWaitMapsWritten(t *testing.T) {
	f := newWaitFixture(t)
	var inits []func(statedb.WriteTxn)
	src := &tables.MasqueradeSource{Prefix: netip.MustParsePrefix("0.0.0.0/0"), Status: reconciler.StatusPending()}
	nonMasq := &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Status: reconciler.StatusPending()}
	f.write(func(wtxn statedb.WriteTxn) {
		inits = append(inits,
			f.sources.RegisterInitializer(wtxn, "test"), f.addrs.RegisterInitializer(wtxn, "test"),
			f.ruleSources.RegisterInitializer(wtxn, "test"), f.nonMasq.RegisterInitializer(wtxn, "test"))
		f.sources.Insert(wtxn, src)
		f.nonMasq.Insert(wtxn, nonMasq)
		f.addrs.Insert(wtxn, &tables.NodeAddress{Addr: netip.MustParseAddr("10.0.0.5"), Status: reconciler.StatusDone()})
	})

	wait := f.wait()
	// Not initialized, rows Pending: it waits (here until the context ends).
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	start := time.Now()
	wait(ctx)
	cancel()
	if time.Since(start) < 50*time.Millisecond {
		t.Fatal("returned while the tables were not initialized and rows were Pending")
	}
	returned := make(chan struct{})
	go func() {
		wait(context.Background())
		close(returned)
	}()
	step := func(what string, fn func(statedb.WriteTxn)) {
		// Long enough for a wrong return to be seen.
		time.Sleep(20 * time.Millisecond)
		select {
		case <-returned:
			t.Fatalf("returned before %s", what)
		default:
		}
		f.write(fn)
	}
	for i, name := range []string{"masquerade-sources", "node-addresses", "masquerade-rule-sources", "nonmasq-cidrs"} {
		step(name+" is initialized", inits[i])
	}
	step("the masquerade source is written", func(wtxn statedb.WriteTxn) {
		f.sources.Insert(wtxn, src.Clone().SetStatus(reconciler.StatusDone()))
	})
	step("the non-masquerade prefix is written", func(wtxn statedb.WriteTxn) {
		f.nonMasq.Insert(wtxn, nonMasq.Clone().SetStatus(reconciler.StatusDone()))
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
	f := newWaitFixture(t)
	f.write(func(wtxn statedb.WriteTxn) {
		f.nonMasq.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Status: reconciler.StatusError(context.DeadlineExceeded)})
	})
	returned := make(chan struct{})
	go func() {
		f.wait()(context.Background())
		close(returned)
	}()
	select {
	case <-returned:
	case <-time.After(3 * mapsWrittenWait):
		t.Fatal("an unwritten row held the attachment back for good")
	}
}

// docs/datapath.md names every table the attachment waits for, its bound
// and its warning, as the code has them.
func TestDocsNameWhatTheAttachmentWaitsFor(t *testing.T) {
	data, err := os.ReadFile("../../docs/datapath.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(data)
	start := strings.Index(doc, "A device is attached only once")
	if start < 0 {
		t.Fatal("docs/datapath.md: no paragraph starting \"A device is attached only once\"")
	}
	para := doc[start:]
	para = para[:strings.Index(para+"\n\n", "\n\n")]
	para = strings.Join(strings.Fields(para), " ")
	f := newWaitFixture(t)
	tbls := mapsWrittenTables{Sources: f.sources, NodeAddrs: f.addrs, RuleSources: f.ruleSources, NonMasq: f.nonMasq}
	want := []string{mapsWrittenWait.String() + " at most", "`" + notWrittenMessage[:strings.Index(notWrittenMessage, ":")] + "`"}
	for _, w := range tbls.list() {
		want = append(want, "`"+w.name+"`")
	}
	for _, w := range want {
		if !strings.Contains(para, w) {
			t.Errorf("docs/datapath.md's paragraph on the attachment's wait does not say %s:\n%s", w, para)
		}
	}
}
