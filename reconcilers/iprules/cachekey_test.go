package iprules

import (
	"net/netip"
	"testing"
	"unsafe"

	"github.com/ipmasq/ipmasq/tables"
)

// TestCacheKeyRoundTrip checks that the cache's compact key gives back the
// rule it was made from and tells apart rules that differ only in family
// (10.0.0.0/8 and its IPv4-mapped IPv6 form) or in a prefix length.
func TestCacheKeyRoundTrip(t *testing.T) {
	keys := []tables.IPRuleKey{
		{Priority: 111, From: netip.MustParsePrefix("10.96.0.1/32"), To: netip.MustParsePrefix("10.0.0.0/8"), Table: 11},
		{Priority: 111, From: netip.MustParsePrefix("::ffff:10.96.0.1/128"), To: netip.MustParsePrefix("::ffff:10.0.0.0/104"), Table: 11},
		{Priority: 110, From: netip.MustParsePrefix("10.96.0.1/32"), To: netip.MustParsePrefix("10.0.0.0/9"), Table: 254},
		{Priority: 111, From: netip.MustParsePrefix("2001:db8::5/128"), To: netip.MustParsePrefix("fd00::/8"), Table: 4294967295},
		{Priority: 0, From: netip.MustParsePrefix("0.0.0.0/0"), To: netip.MustParsePrefix("::/0"), Table: 1},
		// Canonical makes the zero prefix of an invalid one.
		Canonical(tables.IPRuleKey{Priority: 5, From: netip.PrefixFrom(netip.MustParseAddr("10.0.0.1"), 33), To: netip.MustParsePrefix("10.0.0.0/8"), Table: 11}),
	}
	seen := map[cacheKey]tables.IPRuleKey{}
	for _, k := range keys {
		c := toCacheKey(k)
		if got := c.ruleKey(); got != k {
			t.Errorf("%v: round trip gave %v", k, got)
		}
		if prev, dup := seen[c]; dup {
			t.Errorf("%v and %v have the same cache key", prev, k)
		}
		seen[c] = k
	}
	if size := unsafe.Sizeof(cacheKey{}); size > 44 {
		t.Errorf("cacheKey is %d bytes, want at most 44 (the point of it)", size)
	}
}
