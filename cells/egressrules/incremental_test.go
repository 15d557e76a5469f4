package egressrules

import (
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"slices"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// fixture is a controller over real StateDB tables, stepped by hand.
type fixture struct {
	t         *testing.T
	db        *statedb.DB
	cidrs     statedb.RWTable[*tables.NonMasqCIDR]
	endpoints statedb.RWTable[*tables.Endpoint]
	rules     statedb.RWTable[*tables.IPRule]
	c         *controller
	changes   statedb.ChangeIterator[*tables.Endpoint]
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	db := statedb.New()
	cidrs, err := tables.NewNonMasqCIDRTable(db)
	if err != nil {
		t.Fatal(err)
	}
	eps, err := tables.NewEndpointTable(db)
	if err != nil {
		t.Fatal(err)
	}
	rules, err := tables.NewIPRuleTable(db)
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, db: db, cidrs: cidrs, endpoints: eps, rules: rules}
	f.c = newController(controllerParams{
		Log: slog.New(slog.DiscardHandler), DB: db, Config: Config{EgressRulePriority: 111},
		CIDRs: cidrs, Endpoints: eps, Rules: rules,
	}, nil)
	wtxn := db.WriteTxn(eps)
	f.changes, err = eps.Changes(wtxn)
	wtxn.Commit()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.changes.Close)
	return f
}

// step runs one round of the controller and returns the rules it wrote
// (inserted or deleted).
func (f *fixture) step() (added, deleted int) {
	txn := f.db.ReadTxn()
	changes, _ := f.changes.Next(txn)
	return f.c.step(txn, changes)
}

func (f *fixture) setCIDRs(spec ...string) {
	wtxn := f.db.WriteTxn(f.cidrs)
	f.cidrs.DeleteAll(wtxn)
	for _, r := range rows(spec...) {
		r.Status = reconciler.StatusPending()
		f.cidrs.Insert(wtxn, r)
	}
	wtxn.Commit()
}

func (f *fixture) putEndpoints(eps ...*tables.Endpoint) {
	wtxn := f.db.WriteTxn(f.endpoints)
	for _, ep := range eps {
		f.endpoints.Insert(wtxn, ep)
	}
	wtxn.Commit()
}

// check compares ip-rules with a full derivation from both inputs.
func (f *fixture) check(what string) {
	f.t.Helper()
	txn := f.db.ReadTxn()
	want := render(statedb.Collect(f.endpoints.All(txn)), statedb.Collect(f.cidrs.All(txn)), 111)
	var got []string
	for r := range f.rules.All(txn) {
		got = append(got, r.Key().String())
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		f.t.Fatalf("%s: ip-rules differ from a full derivation:\ngot  %d %v\nwant %d %v", what, len(got), got, len(want), want)
	}
}

func endpoint(i int, table uint32) *tables.Endpoint {
	return &tables.Endpoint{IP: netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}), RouteTable: table}
}

func manyCIDRs(n int) []string {
	out := make([]string, n)
	for i := range n {
		out[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{100, 64 + byte(i>>14), byte(i >> 6), byte(i << 2)}), 30).String()
	}
	return out
}

// allocated returns the bytes fn allocates.
func allocated(fn func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	fn()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// TestEndpointWithoutTableCostsNothing: with 16 384 prefixes and 1 000
// endpoints without a route table, one more such endpoint must cost the
// controller neither rules nor prefix-proportional work. Re-deriving all
// templates (a map and two slices of 16 384) on every endpoint change
// allocated ~3 MiB per change; endpoints × prefixes, the crash loop of
// issue #14, over a GiB.
func TestEndpointWithoutTableCostsNothing(t *testing.T) {
	f := newFixture(t)
	f.setCIDRs(manyCIDRs(16384)...)
	for i := range 1000 {
		f.putEndpoints(endpoint(i, 0))
	}
	if a, d := f.step(); a+d != 0 {
		t.Fatalf("initial derivation wrote %d+%d rules, want none", a, d)
	}
	var a, d int
	alloc := allocated(func() {
		f.putEndpoints(endpoint(1000, 0))
		a, d = f.step()
	})
	if a+d != 0 {
		t.Fatalf("an endpoint without a route table wrote %d+%d rules", a, d)
	}
	// The insert itself and one round of the controller: a few KiB.
	const limit = 256 << 10
	if alloc > limit {
		t.Fatalf("one endpoint without a route table allocated %d KiB (limit %d KiB): work proportional to the prefixes?", alloc>>10, limit>>10)
	}
}

// TestEndpointChangeTouchesOnlyItsRules: adding an endpoint with a route
// table writes exactly its rules, and costs the same whether 100 or 1 000
// endpoints already have theirs (a full re-derivation costs 10× more at
// 1 000).
func TestEndpointChangeTouchesOnlyItsRules(t *testing.T) {
	cost := map[int]uint64{}
	for _, n := range []int{100, 1000} {
		f := newFixture(t)
		f.setCIDRs(manyCIDRs(64)...)
		for i := range n {
			f.putEndpoints(endpoint(i, 11))
		}
		if a, _ := f.step(); a != n*64 {
			t.Fatalf("%d endpoints: initial derivation added %d rules, want %d", n, a, n*64)
		}
		before := f.rules.Revision(f.db.ReadTxn())
		var a, d int
		cost[n] = allocated(func() {
			f.putEndpoints(endpoint(n, 11))
			a, d = f.step()
		})
		if a != 64 || d != 0 {
			t.Fatalf("%d endpoints: one more endpoint added %d and deleted %d rules, want 64 and 0", n, a, d)
		}
		written := 0
		for _, rev := range f.rules.All(f.db.ReadTxn()) {
			if rev > before {
				written++
			}
		}
		if written != 64 {
			t.Fatalf("%d endpoints: %d rule rows rewritten, want the new endpoint's 64", n, written)
		}
		f.check("after one endpoint more")
	}
	if cost[1000] > 2*cost[100] {
		t.Fatalf("one endpoint change allocated %d KiB with 1 000 endpoints, %d KiB with 100: proportional to all endpoints", cost[1000]>>10, cost[100]>>10)
	}
}

// TestConfigChangeTouchesOnlyChangedPrefixes: one prefix more writes one
// rule per endpoint with a table; a status commit on nonmasq-cidrs (the map
// reconciler's) writes none.
func TestConfigChangeTouchesOnlyChangedPrefixes(t *testing.T) {
	f := newFixture(t)
	base := []string{"10.0.0.0/8", "172.16.0.0/12", "masq:10.96.0.0/12"}
	f.setCIDRs(base...)
	for i := range 1000 {
		f.putEndpoints(endpoint(i, uint32(11+i%2)), endpoint(2000+i, 0))
	}
	f.step()
	f.check("initial")

	f.setCIDRs(append(base, "198.18.0.0/15")...)
	if a, d := f.step(); a != 1000 || d != 0 {
		t.Fatalf("one prefix more: added %d, deleted %d rules, want 1000 and 0", a, d)
	}
	f.check("one prefix more")

	wtxn := f.db.WriteTxn(f.cidrs)
	for r := range f.cidrs.All(wtxn) {
		f.cidrs.Insert(wtxn, r.Clone().SetStatus(reconciler.StatusDone()))
	}
	wtxn.Commit()
	if a, d := f.step(); a+d != 0 {
		t.Fatalf("status commit wrote %d+%d rules, want none", a, d)
	}
}

// TestIncrementalMatchesFullDerivation applies random endpoint and config
// changes (nested exceptions, both families, route table moves, deletes)
// and compares ip-rules with a full derivation after every round.
func TestIncrementalMatchesFullDerivation(t *testing.T) {
	f := newFixture(t)
	rng := rand.New(rand.NewPCG(1, 14))
	pool := []string{"10.0.0.0/8", "masq:10.96.0.0/12", "10.96.1.0/24", "172.16.0.0/12", "masq:172.16.5.0/24",
		"192.168.0.0/16", "fd00::/8", "masq:fd00:1::/32", "fe80::/10", "100.64.0.0/10"}
	ep := func(i int, table uint32) *tables.Endpoint {
		if i%3 == 0 {
			return &tables.Endpoint{IP: netip.AddrFrom16([16]byte{0xfd, 0x10, 15: byte(i)}), RouteTable: table}
		}
		return endpoint(i, table)
	}
	for round := range 300 {
		switch rng.IntN(4) {
		case 0:
			var spec []string
			for _, p := range pool {
				if rng.IntN(2) == 0 {
					spec = append(spec, p)
				}
			}
			f.setCIDRs(spec...)
		case 1:
			f.putEndpoints(ep(rng.IntN(40), uint32(rng.IntN(3))*10))
		case 2:
			wtxn := f.db.WriteTxn(f.endpoints)
			f.endpoints.Delete(wtxn, ep(rng.IntN(40), 0))
			wtxn.Commit()
		case 3: // several changes of both inputs in one round
			f.putEndpoints(ep(rng.IntN(40), 7), ep(rng.IntN(40), 0))
			wtxn := f.db.WriteTxn(f.endpoints)
			f.endpoints.Delete(wtxn, ep(rng.IntN(40), 0))
			wtxn.Commit()
			f.putEndpoints(ep(rng.IntN(40), 9))
			f.setCIDRs(pool[rng.IntN(len(pool)):]...)
		}
		f.step()
		f.check("round " + string(rune('0'+round%10)))
	}
}

// TestDiffTemplates checks the merge against set differences on random
// template lists.
func TestDiffTemplates(t *testing.T) {
	rng := rand.New(rand.NewPCG(14, 3))
	random := func() []template {
		var cidrs []*tables.NonMasqCIDR
		seen := map[netip.Prefix]bool{}
		for range rng.IntN(40) {
			p, _ := netip.AddrFrom4([4]byte{10, byte(rng.IntN(4)), byte(rng.IntN(4)), 0}).Prefix(8 + rng.IntN(17))
			if !seen[p] {
				seen[p] = true
				cidrs = append(cidrs, &tables.NonMasqCIDR{Prefix: p, Action: tables.Action(rng.IntN(2))})
			}
		}
		v4, _, _ := templates(cidrs, 111)
		return v4
	}
	for range 500 {
		old, cur := random(), random()
		gone, fresh := diffTemplates(old, cur)
		if !slices.Equal(gone, minus(old, cur)) || !slices.Equal(fresh, minus(cur, old)) {
			t.Fatalf("diff of\n%v\n%v\ngave gone %v fresh %v", old, cur, gone, fresh)
		}
	}
}

func minus(a, b []template) []template {
	var out []template
	for _, x := range a {
		if !slices.Contains(b, x) {
			out = append(out, x)
		}
	}
	return out
}
