package iprules

import (
	"net/netip"

	"github.com/ipmasq/ipmasq/tables"
)

// cacheKey is an IPRuleKey as Ops's cache of owned rules holds it: 44
// bytes without pointers instead of 72 with two (netip.Addr keeps its zone
// behind a pointer). At 20 000 rules the cache took 3 MB of the agent's
// live heap, and a pointer-free map is never scanned by the collector.
type cacheKey struct {
	from, to         [16]byte
	priority, table  uint32
	fromBits, toBits uint8
	// family is 4, 6, or 0 for the zero (invalid) prefix a canonical key
	// holds when its prefix was not valid.
	fromFamily, toFamily uint8
}

func toCacheKey(k tables.IPRuleKey) cacheKey {
	c := cacheKey{priority: k.Priority, table: k.Table}
	c.from, c.fromBits, c.fromFamily = packPrefix(k.From)
	c.to, c.toBits, c.toFamily = packPrefix(k.To)
	return c
}

// ruleKey returns the IPRuleKey c was made from.
func (c cacheKey) ruleKey() tables.IPRuleKey {
	return tables.IPRuleKey{
		Priority: c.priority,
		From:     unpackPrefix(c.from, c.fromBits, c.fromFamily),
		To:       unpackPrefix(c.to, c.toBits, c.toFamily),
		Table:    c.table,
	}
}

// packPrefix packs a canonical prefix: valid, or the zero Prefix that
// Masked makes of an invalid one. Prefixes never carry a zone.
func packPrefix(p netip.Prefix) (addr [16]byte, bits, family uint8) {
	if !p.IsValid() {
		return addr, 0, 0
	}
	family = 6
	if p.Addr().Is4() {
		family = 4
	}
	return p.Addr().As16(), uint8(p.Bits()), family
}

func unpackPrefix(addr [16]byte, bits, family uint8) netip.Prefix {
	switch family {
	case 4:
		return netip.PrefixFrom(netip.AddrFrom16(addr).Unmap(), int(bits))
	case 6:
		return netip.PrefixFrom(netip.AddrFrom16(addr), int(bits))
	}
	return netip.Prefix{}
}
