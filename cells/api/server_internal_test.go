package api

import (
	"bytes"
	"encoding/json"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/tables"
)

// TestWriteAllocationEncodesAsBefore: splicing the pre-encoded CIDR list
// gives byte for byte what encoding the whole response does.
func TestWriteAllocationEncodesAsBefore(t *testing.T) {
	ep := tables.Endpoint{IP: netip.MustParseAddr("10.244.1.7"), Owner: `ctr-<1>&"x"/eth0`, RouteTable: 11, Created: time.Date(2026, 11, 30, 13, 0, 0, 0, time.UTC)}
	for _, tc := range []struct {
		name  string
		cidrs []netip.Prefix
		pool  netip.Prefix
	}{
		{"CIDRs and pool", []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("169.254.0.0/16")}, netip.MustParsePrefix("10.244.1.0/24")},
		{"no CIDRs", nil, netip.MustParsePrefix("10.244.1.0/24")},
		{"outside the pools", []netip.Prefix{netip.MustParsePrefix("fd00::/8")}, netip.Prefix{}},
		{"neither", nil, netip.Prefix{}},
	} {
		a := ipam.Allocation{Endpoint: ep, NonMasqueradeCIDRs: tc.cidrs, Pool: tc.pool}
		if len(tc.cidrs) > 0 {
			a.NonMasqueradeCIDRsJSON, _ = json.Marshal(tc.cidrs)
		}
		rec := httptest.NewRecorder()
		writeAllocation(rec, 201, a)
		var want bytes.Buffer
		json.NewEncoder(&want).Encode(response(ep, tc.cidrs, tc.pool))
		if rec.Body.String() != want.String() || rec.Code != 201 || rec.Header().Get("Content-Type") != "application/json" {
			t.Errorf("%s: got %d %q\n%s\nwant\n%s", tc.name, rec.Code, rec.Header().Get("Content-Type"), rec.Body, want.String())
		}
	}
}
