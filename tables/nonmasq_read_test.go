package tables

import (
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/cilium/statedb"
)

// TestLongestMatch compares LongestMatch with a scan of every row, for
// random nested prefixes of both families and random addresses in and
// around them (IPv4-mapped IPv6 addresses count as IPv4).
func TestLongestMatch(t *testing.T) {
	db := statedb.New()
	tbl, err := NewNonMasqCIDRTable(db)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(14, 2))
	randAddr := func(v6 bool) netip.Addr {
		if v6 {
			var b [16]byte
			b[0], b[1], b[15] = 0xfd, byte(rng.IntN(4)), byte(rng.IntN(256))
			return netip.AddrFrom16(b)
		}
		return netip.AddrFrom4([4]byte{10, byte(rng.IntN(4)), byte(rng.IntN(4)), byte(rng.IntN(256))})
	}
	var rows []*NonMasqCIDR
	wtxn := db.WriteTxn(tbl)
	for range 200 {
		a := randAddr(rng.IntN(2) == 0)
		p, _ := a.Prefix(rng.IntN(a.BitLen() + 1))
		r := &NonMasqCIDR{Prefix: p, Action: Action(rng.IntN(2))}
		if _, had, _ := tbl.Insert(wtxn, r); !had {
			rows = append(rows, r)
		} else {
			for i := range rows {
				if rows[i].Prefix == p {
					rows[i] = r
				}
			}
		}
	}
	txn := wtxn.Commit()

	for i := range 5000 {
		addr := randAddr(i%2 == 0)
		var want *NonMasqCIDR
		for _, r := range rows {
			if r.Prefix.Contains(addr) && (want == nil || r.Prefix.Bits() > want.Prefix.Bits()) {
				want = r
			}
		}
		query := addr
		if i%4 == 0 && addr.Is4() {
			query = netip.AddrFrom16(addr.As16()) // ::ffff:a.b.c.d
		}
		got, ok := LongestMatch(txn, tbl, query)
		if ok != (want != nil) || (ok && got.Prefix != want.Prefix) {
			t.Fatalf("LongestMatch(%s) = %v, %v; want %v", query, got, ok, want)
		}
		if ShouldMasquerade(txn, tbl, query) != (want == nil || want.Action == ActionMasquerade) {
			t.Fatalf("ShouldMasquerade(%s) disagrees with the longest match %v", query, want)
		}
	}
	if _, ok := LongestMatch(txn, tbl, netip.Addr{}); ok {
		t.Fatal("the zero address matched a row")
	}
}
