package bpf

import (
	"net/netip"
	"strconv"
)

// User masquerade rules cover sources that are not pods, e.g. WireGuard
// clients (192.168.6.0/24 arriving on wg0): "masquerade these sources when
// they leave through this device, to the device's own address or to the
// rule's address". The egress program looks them up only for sources whose
// masq_src_* entry has MasqSrcRules, by (egress ifindex, source), longest
// source prefix first, before it takes the entry's MasqSrcMasquerade: a
// rule found for the device wins (its toAddress), also for a source that
// is masqueraded anyway. Everything else about the decision (node and
// non-masquerade destinations, the device being an egress device) is the
// same as for pods.
//
// Replies need nothing rule-specific: the NAT pair records the SNAT address
// the flow was given. A changed rule applies to new flows; a removed rule
// stops translating the flows it started (see masq_source_v4 in lib/decision.h).

type (
	// MasqRuleKeyV4 is a key of masq_rules_v4: PrefixLen counts the 32 bits
	// of Ifindex (host byte order) plus the source prefix length, Addr is
	// the source prefix (network byte order). Build it with
	// [MasqRuleKeyV4From].
	MasqRuleKeyV4 = masqMasqRuleV4Key
	// MasqRuleKeyV6 is a key of masq_rules_v6, like [MasqRuleKeyV4] with a
	// 16-byte Addr. Build it with [MasqRuleKeyV6From].
	MasqRuleKeyV6 = masqMasqRuleV6Key
	// MasqRule is a value of masq_rules_v4 and masq_rules_v6: HasTo 1 means
	// SNAT to ToV4 (in masq_rules_v4) or ToV6 (in masq_rules_v6) rather than
	// to the egress device's address. Build it with [MasqRuleTo].
	MasqRule = masqMasqRule
)

// ifindexBits is the part of a rule key's PrefixLen taken by the ifindex.
const ifindexBits = 32

// MasqRuleKeyV4From returns the masq_rules_v4 key of a rule for the sources
// in src leaving through ifindex. Host bits of src are cleared and an
// IPv4-mapped prefix is unmapped. It panics if src is not a valid IPv4
// prefix, like [LPMKeyV4From].
func MasqRuleKeyV4From(ifindex int, src netip.Prefix) MasqRuleKeyV4 {
	k := LPMKeyV4From(src)
	return MasqRuleKeyV4{Prefixlen: ifindexBits + k.Prefixlen, Ifindex: uint32(ifindex), Addr: k.Addr}
}

// MasqRuleKeyV6From returns the masq_rules_v6 key of a rule for the sources
// in src leaving through ifindex, with host bits cleared. It panics if src
// is not a valid IPv6 prefix, like [LPMKeyV6From].
func MasqRuleKeyV6From(ifindex int, src netip.Prefix) MasqRuleKeyV6 {
	k := LPMKeyV6From(src)
	return MasqRuleKeyV6{Prefixlen: ifindexBits + k.Prefixlen, Ifindex: uint32(ifindex), Addr: k.Addr}
}

// Source returns the rule's source prefix.
func (k MasqRuleKeyV4) Source() netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4(k.Addr), int(k.Prefixlen)-ifindexBits)
}

// Source returns the rule's source prefix.
func (k MasqRuleKeyV6) Source() netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom16(k.Addr), int(k.Prefixlen)-ifindexBits)
}

// String returns "ifindex N source/len", so that errors name the rule.
func (k MasqRuleKeyV4) String() string {
	return "ifindex " + strconv.FormatUint(uint64(k.Ifindex), 10) + " " + k.Source().String()
}

// String returns "ifindex N source/len", so that errors name the rule.
func (k MasqRuleKeyV6) String() string {
	return "ifindex " + strconv.FormatUint(uint64(k.Ifindex), 10) + " " + k.Source().String()
}

// MasqRuleTo returns the value of a rule that masquerades to to, or to the
// egress device's own address of the rule's family when to is the zero
// Addr. to must be of the family of the map the value goes in (an
// IPv4-mapped address counts as IPv4); the config's checks see to that
// (a rule's toAddress is of its sources' family).
func MasqRuleTo(to netip.Addr) MasqRule {
	var r MasqRule
	switch {
	case !to.IsValid():
	case to.Unmap().Is4():
		r.ToV4, r.HasTo = Addr4(to), 1
	default:
		r.ToV6, r.HasTo = to.As16(), 1
	}
	return r
}
