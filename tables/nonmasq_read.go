package tables

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/cilium/statedb"
)

// LongestMatch returns the row whose prefix is the longest match for addr.
// It probes the primary index once per prefix length, longest first (at
// most 33 lookups for IPv4, 129 for IPv6), so that the table needs no
// longest-match index to keep up to date on every write.
func LongestMatch(txn statedb.ReadTxn, tbl statedb.Table[*NonMasqCIDR], addr netip.Addr) (*NonMasqCIDR, bool) {
	addr = addr.Unmap()
	if !addr.IsValid() {
		return nil, false
	}
	for bits := addr.BitLen(); bits >= 0; bits-- {
		p, _ := addr.Prefix(bits)
		if row, _, ok := tbl.Get(txn, NonMasqCIDRByPrefix.Query(p)); ok {
			return row, true
		}
	}
	return nil, false
}

// ShouldMasquerade is the decision the datapath makes for a destination:
// masquerade unless the longest matching prefix says no-masquerade.
func ShouldMasquerade(txn statedb.ReadTxn, tbl statedb.Table[*NonMasqCIDR], dst netip.Addr) bool {
	row, ok := LongestMatch(txn, tbl, dst)
	return !ok || row.Action == ActionMasquerade
}

// NoMasqueradePrefixes lists the no-masquerade prefixes of one family, in
// prefix order. masqueradeCIDRs exceptions are not included.
func NoMasqueradePrefixes(txn statedb.ReadTxn, tbl statedb.Table[*NonMasqCIDR], family Family) []netip.Prefix {
	var out []netip.Prefix
	for row := range tbl.All(txn) {
		if row.Action == ActionNoMasquerade && FamilyOf(row.Prefix.Addr()) == family {
			out = append(out, row.Prefix)
		}
	}
	return out
}

// WaitForConfig blocks until the nonmasq-cidrs table holds the first loaded
// config (or the decision that there is no file) and returns a read
// transaction that sees it. Readers use it instead of depending on the
// config cell's start order.
func WaitForConfig(ctx context.Context, db *statedb.DB, tbl statedb.Table[*NonMasqCIDR]) (statedb.ReadTxn, error) {
	txn := db.ReadTxn()
	init, watch := tbl.Initialized(txn)
	if init {
		return txn, nil
	}
	select {
	case <-watch:
		return db.ReadTxn(), nil
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for the first masquerade config load (pending: %v): %w",
			tbl.PendingInitializers(txn), ctx.Err())
	}
}
