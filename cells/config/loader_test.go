package config

import (
	"bytes"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// TestApplyTouchesOnlyChangedRows: each new file leaves nonmasq-cidrs
// holding exactly its Entries, and rows that did not change keep their
// revision (the map reconciler and the rules controller see only real
// changes), across both families, IPv6 prefixes on either side of the
// IPv4-mapped range, and action and origin changes of a kept prefix.
func TestApplyTouchesOnlyChangedRows(t *testing.T) {
	files := []string{
		`{"nonMasqueradeCIDRs": ["10.0.0.0/8", "::/0", "64:ff9b::/96", "2001:db8::/32", "192.168.0.0/16"]}`,
		// 10/8 goes, 172.16/12 comes, ::/0 stays, 192.168/16 becomes a
		// masquerade exception, link-local v4 goes.
		`{"nonMasqueradeCIDRs": ["172.16.0.0/12", "::/0", "64:ff9b::/96", "2001:db8::/32"], "masqueradeCIDRs": ["192.168.0.0/16"], "masqLinkLocal": true}`,
		// Only the IPv6 prefix below ::ffff:0:0 changes.
		`{"nonMasqueradeCIDRs": ["172.16.0.0/12", "::/1", "64:ff9b::/96", "2001:db8::/32"], "masqueradeCIDRs": ["192.168.0.0/16"], "masqLinkLocal": true}`,
		// The same list in another order: nothing changes.
		`{"masqLinkLocal": true, "nonMasqueradeCIDRs": ["2001:db8::/32", "64:ff9b::/96", "::/1", "172.16.0.0/12"], "masqueradeCIDRs": ["192.168.0.0/16"]}`,
		// No list: the reserved defaults, link-local v6 stays.
		`{}`,
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "ip-masq-agent")
	hostileWrite(t, path, []byte(files[0]))
	hh := startHostileHive(t, path, false)

	type rowRev struct {
		row Entry
		rev statedb.Revision
	}
	table := func() []rowRev {
		var out []rowRev
		for row, rev := range hh.cidrs.All(hh.db.ReadTxn()) {
			out = append(out, rowRev{Entry{row.Prefix, row.Action, row.Origin}, rev})
		}
		slices.SortFunc(out, func(a, b rowRev) int { return a.row.Prefix.Compare(b.row.Prefix) })
		return out
	}
	lim := Limits{EnableIPv4: true, EnableIPv6: true, MaxCIDRsPerFamily: 16384}
	var (
		before   []rowRev
		lastLoad time.Time
	)
	for i, content := range files {
		if i > 0 {
			hostileWrite(t, path, []byte(content))
		}
		st := hh.waitStatus(t, "the file applied", func(st *tables.ConfigStatus) bool {
			return st.LastGoodLoad.After(lastLoad) && st.LastError == ""
		})
		lastLoad = st.LastGoodLoad
		f, err := Parse(path, []byte(content), lim)
		if err != nil {
			t.Fatal(err)
		}
		got := table()
		rows := make([]Entry, len(got))
		for k, r := range got {
			rows[k] = r.row
		}
		if want := f.Entries(lim); !slices.Equal(rows, want) {
			t.Fatalf("file %d: table holds %v, want %v", i, rows, want)
		}
		for _, g := range got {
			k := slices.IndexFunc(before, func(b rowRev) bool { return b.row == g.row })
			if k >= 0 && before[k].rev != g.rev {
				t.Errorf("file %d: unchanged row %v was rewritten (revision %d → %d)", i, g.row, before[k].rev, g.rev)
			}
		}
		before = got
	}
}

// TestApplyAllocatesRowsInBlocks: applying a large new file costs the
// table's own allocations for its inserts and almost nothing per row on
// top (the rows come from a few blocks, not one allocation each: issue #14).
func TestApplyAllocatesRowsInBlocks(t *testing.T) {
	const n = 4096
	entries := entries24(10, n)
	rows := make([]*tables.NonMasqCIDR, n)
	for i, e := range entries {
		rows[i] = &tables.NonMasqCIDR{Prefix: e.Prefix, Status: reconciler.StatusPending()}
	}
	fill := func(apply func(*loader, statedb.WriteTxn)) float64 {
		return testing.AllocsPerRun(5, func() {
			l := newTableLoader(t)
			wtxn := l.db.WriteTxn(l.cidrs)
			apply(l, wtxn)
			wtxn.Abort()
		})
	}
	table := fill(func(l *loader, wtxn statedb.WriteTxn) {
		for _, r := range rows {
			l.cidrs.Insert(wtxn, r)
		}
	})
	var changed int
	apply := fill(func(l *loader, wtxn statedb.WriteTxn) { changed = l.applyCIDRs(wtxn, entries) })
	if changed != n {
		t.Fatalf("applyCIDRs changed %d rows, want %d", changed, n)
	}
	if extra := apply - table; extra > n/8 {
		t.Errorf("applying %d new rows allocated %.0f times more than inserting them (%.0f vs %.0f); want a few blocks, not one per row",
			n, extra, apply, table)
	}
}

// entries24 returns n configured no-masquerade entries, first.x.y.0/24 in
// order.
func entries24(first byte, n int) []Entry {
	out := make([]Entry, n)
	for i := range out {
		p := netip.PrefixFrom(netip.AddrFrom4([4]byte{first, byte(i >> 8), byte(i), 0}), 24)
		out[i] = Entry{Prefix: p, Action: tables.ActionNoMasquerade, Origin: tables.OriginConfig}
	}
	return out
}

// newTableLoader returns a loader over a nonmasq-cidrs table of its own
// (only applyCIDRs can be used: no status or rules table, no file).
func newTableLoader(tb testing.TB) *loader {
	db := statedb.New()
	cidrs, err := tables.NewNonMasqCIDRTable(db)
	if err != nil {
		tb.Fatal(err)
	}
	return &loader{db: db, cidrs: cidrs}
}

// BenchmarkApplyCIDRs measures the loader's part of a new config in its
// table transaction: n prefixes replace an empty table, the keys of two
// alternating sets still in the graveyard of a delete tracker, as in the
// agent (the map reconciler tracks deletions).
func BenchmarkApplyCIDRs(b *testing.B) {
	for _, n := range []int{1000, 16384} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			l := newTableLoader(b)
			wtxn := l.db.WriteTxn(l.cidrs)
			if _, err := l.cidrs.Changes(wtxn); err != nil {
				b.Fatal(err)
			}
			wtxn.Commit()
			sets := [][]Entry{entries24(10, n), entries24(11, n)}
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				wtxn := l.db.WriteTxn(l.cidrs)
				l.applyCIDRs(wtxn, nil)
				wtxn.Commit()
				b.StartTimer()
				wtxn = l.db.WriteTxn(l.cidrs)
				if got := l.applyCIDRs(wtxn, sets[i%2]); got != n {
					b.Fatalf("%d rows changed, want %d", got, n)
				}
				wtxn.Commit()
			}
		})
	}
}

// TestResyncThatChangesNothingIsQuiet: the first load, a change and a
// recovery from a rejected file are logged at INFO; the periodic re-read of
// an unchanged file (every resyncInterval) logs nothing at INFO.
func TestResyncThatChangesNothingIsQuiet(t *testing.T) {
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	db := statedb.New()
	cidrs, err := tables.NewNonMasqCIDRTable(db)
	if err != nil {
		t.Fatal(err)
	}
	status, err := tables.NewConfigStatusTable(db)
	if err != nil {
		t.Fatal(err)
	}
	rules, err := tables.NewMasqueradeRuleTable(db)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	_, health := cell.NewSimpleHealth()
	l := newLoader(log, db, cidrs, status, rules, path,
		Limits{EnableIPv4: true, EnableIPv6: true, MaxCIDRsPerFamily: 16384}, health.NewScope("config"))
	applied := func() int { return strings.Count(logs.String(), `msg="Config applied"`) }
	resync := func() { l.lastInput = ""; l.load() }

	hostileWrite(t, path, []byte(`{"nonMasqueradeCIDRs": ["10.0.0.0/8"]}`))
	l.load()
	if applied() != 1 {
		t.Fatalf("first load: want one INFO line, got:\n%s", logs.String())
	}
	resync()
	resync()
	if applied() != 1 {
		t.Fatalf("resyncs of an unchanged file logged at INFO:\n%s", logs.String())
	}
	hostileWrite(t, path, []byte(`{"nonMasqueradeCIDRs": ["10.0.0.0/8", "172.16.0.0/12"]}`))
	l.load()
	if applied() != 2 {
		t.Fatalf("a change: want a second INFO line, got:\n%s", logs.String())
	}
	hostileWrite(t, path, []byte(`{"nonMasqueradeCIDRs": ["bogus"]}`))
	l.load()
	hostileWrite(t, path, []byte(`{"nonMasqueradeCIDRs": ["10.0.0.0/8", "172.16.0.0/12"]}`))
	l.load()
	if applied() != 3 {
		t.Fatalf("recovery from a rejected file: want a third INFO line, got:\n%s", logs.String())
	}
	resync()
	if applied() != 3 {
		t.Fatalf("resync after recovery logged at INFO:\n%s", logs.String())
	}
}
