package egressrules

import (
	"net/netip"
	"testing"

	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// commitStatus does what the map reconciler does after writing rows: the
// same rows again with status Done.
func (f *fixture) commitStatus(prefixes ...string) {
	wtxn := f.db.WriteTxn(f.cidrs)
	for _, s := range prefixes {
		r, _, ok := f.cidrs.Get(wtxn, tables.NonMasqCIDRByPrefix.Query(netip.MustParsePrefix(s)))
		if !ok {
			f.t.Fatalf("no row %s", s)
		}
		f.cidrs.Insert(wtxn, r.Clone().SetStatus(reconciler.StatusDone()))
	}
	wtxn.Commit()
}

// TestConfigChangeWithoutTableEndpointsCostsNothing: with 1 000 endpoints,
// none with a route table, a new 16 384-prefix config and the status
// commit after it cost the controller no derivation: no rule can come of
// the templates. Deriving them allocated ~2 MiB per config change and read
// every row again for the status commit.
func TestConfigChangeWithoutTableEndpointsCostsNothing(t *testing.T) {
	f := newFixture(t)
	f.setCIDRs(manyCIDRs(16384)...)
	for i := range 1000 {
		f.putEndpoints(endpoint(i, 0))
	}
	f.step()
	next := manyCIDRs(16385)[1:] // every prefix but one is a new row
	f.setCIDRs(next...)
	var a, d int
	alloc := allocated(func() { a, d = f.step() })
	if a+d != 0 {
		t.Fatalf("config change wrote %d+%d rules, want none", a, d)
	}
	f.commitStatus(next...)
	alloc += allocated(func() { a, d = f.step() })
	if a+d != 0 {
		t.Fatalf("status commit wrote %d+%d rules, want none", a, d)
	}
	// One round of the controller each: a few KiB.
	const limit = 64 << 10
	if alloc > limit {
		t.Fatalf("config change and status commit allocated %d KiB (limit %d KiB): templates derived with no endpoint to use them?", alloc>>10, limit>>10)
	}
	if f.c.cidrRowsRead != 0 {
		t.Fatalf("read %d nonmasq-cidrs rows with no endpoint that has a route table, want 0", f.c.cidrRowsRead)
	}
	f.check("after the config change")
}

// TestFirstTableEndpointGetsCurrentConfig: config changes made while no
// endpoint has a route table are derived as soon as the first one arrives,
// in the same round; and again after the last one left and the config
// changed.
func TestFirstTableEndpointGetsCurrentConfig(t *testing.T) {
	f := newFixture(t)
	f.setCIDRs("10.0.0.0/8", "172.16.0.0/12")
	f.putEndpoints(endpoint(1, 0))
	f.step()
	f.setCIDRs("10.0.0.0/8", "masq:10.96.0.0/12", "10.96.1.0/24", "192.168.0.0/16", "fd00::/8")
	f.step()
	f.check("config change, no endpoint with a table")

	f.putEndpoints(endpoint(2, 11))
	if a, d := f.step(); a != 4 || d != 0 {
		t.Fatalf("first endpoint with a table: added %d, deleted %d rules, want 4 and 0", a, d)
	}
	f.check("first endpoint with a table")

	// The last one leaves; the config changes; another arrives, together
	// with one more without a table.
	wtxn := f.db.WriteTxn(f.endpoints)
	f.endpoints.Delete(wtxn, endpoint(2, 0))
	wtxn.Commit()
	f.step()
	f.setCIDRs("100.64.0.0/10", "fd00::/8")
	f.step()
	f.putEndpoints(endpoint(3, 0), endpoint(4, 12), &tables.Endpoint{IP: netip.MustParseAddr("fd10::4"), RouteTable: 12})
	if a, d := f.step(); a != 2 || d != 0 {
		t.Fatalf("endpoints with a table after the config change: added %d, deleted %d rules, want 2 and 0", a, d)
	}
	f.check("endpoints with a table after the last one left")
}

// TestStatusCommitReadsOnlyWrittenRows: with endpoints that have a route
// table, the map reconciler's status commit after one changed prefix makes
// the controller read that row, not the 16 384 of the table, and write no
// rule.
func TestStatusCommitReadsOnlyWrittenRows(t *testing.T) {
	f := newFixture(t)
	cidrs := manyCIDRs(16384)
	f.setCIDRs(cidrs...)
	f.putEndpoints(endpoint(1, 11), endpoint(2, 0))
	f.step()
	f.commitStatus(cidrs...)
	f.step()

	f.c.cidrRowsRead = 0
	wtxn := f.db.WriteTxn(f.cidrs)
	f.cidrs.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix("198.18.0.0/15"), Status: reconciler.StatusPending()})
	wtxn.Commit()
	if a, d := f.step(); a != 1 || d != 0 {
		t.Fatalf("one prefix more: added %d, deleted %d rules, want 1 and 0", a, d)
	}
	f.c.cidrRowsRead = 0
	f.commitStatus("198.18.0.0/15")
	if a, d := f.step(); a+d != 0 {
		t.Fatalf("status commit wrote %d+%d rules, want none", a, d)
	}
	if f.c.cidrRowsRead != 1 {
		t.Fatalf("status commit of one row read %d nonmasq-cidrs rows, want 1", f.c.cidrRowsRead)
	}
	f.check("after the status commit")
}
