package ipam

import (
	"net/netip"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// TestCIDRCacheFollowsTheTable: one read and one encoding per table
// revision, shared by every answer at that revision; a new revision is read
// again; a reader holding an older snapshot gets that snapshot's prefixes.
func TestCIDRCacheFollowsTheTable(t *testing.T) {
	db := statedb.New()
	tbl, err := tables.NewNonMasqCIDRTable(db)
	if err != nil {
		t.Fatal(err)
	}
	put := func(prefixes ...string) statedb.ReadTxn {
		wtxn := db.WriteTxn(tbl)
		tbl.DeleteAll(wtxn)
		for _, p := range prefixes {
			tbl.Insert(wtxn, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(p), Status: reconciler.StatusPending()})
		}
		return wtxn.Commit()
	}
	var c cidrCache
	old := put("10.0.0.0/8", "fd00::/8")
	a, _ := c.get(old, tbl, tables.IPv4)
	b, _ := c.get(db.ReadTxn(), tbl, tables.IPv4)
	if a != b || string(a.JSON) != `["10.0.0.0/8"]` {
		t.Fatalf("same revision: lists %p and %p, JSON %s; want one shared list [10.0.0.0/8]", a, b, a.JSON)
	}
	if v6, _ := c.get(db.ReadTxn(), tbl, tables.IPv6); string(v6.JSON) != `["fd00::/8"]` {
		t.Fatalf("IPv6 JSON %s", v6.JSON)
	}

	put("192.168.0.0/16", "172.16.0.0/12")
	n, _ := c.get(db.ReadTxn(), tbl, tables.IPv4)
	if string(n.JSON) != `["172.16.0.0/12","192.168.0.0/16"]` {
		t.Fatalf("after a config change: JSON %s", n.JSON)
	}
	if v6, _ := c.get(db.ReadTxn(), tbl, tables.IPv6); v6.JSON != nil || v6.Prefixes != nil {
		t.Fatalf("no IPv6 prefixes left, got %v %s", v6.Prefixes, v6.JSON)
	}
	if o, _ := c.get(old, tbl, tables.IPv4); string(o.JSON) != `["10.0.0.0/8"]` {
		t.Fatalf("older snapshot: JSON %s, want its own [10.0.0.0/8]", o.JSON)
	}
	if again, _ := c.get(db.ReadTxn(), tbl, tables.IPv4); again != n {
		t.Fatal("an older reader replaced the newer cached list")
	}
}
