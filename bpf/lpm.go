package bpf

import (
	"fmt"
	"net/netip"
	"strconv"
)

// LPMKeyV4 is the key of the IPv4 LPM tries (nonmasq_v4, masq_src_v4):
// lib/types.h's struct lpm_v4_key as bpf2go generates it. Prefixlen is in host
// byte order, Addr in network byte order.
type LPMKeyV4 = masqLpmV4Key

// LPMKeyV6 is the key of the IPv6 LPM tries (nonmasq_v6, masq_src_v6):
// lib/types.h's struct lpm_v6_key.
type LPMKeyV6 = masqLpmV6Key

// LPMKeyV4From returns the key for an IPv4 prefix. Host bits are cleared, so
// that 10.0.0.1/8 and 10.0.0.0/8 give the same key, as they are the same
// entry to the kernel. An IPv4-mapped IPv6 prefix (::ffff:a.b.c.d/96+n) is
// unmapped. It panics if p is not a valid IPv4 prefix, like netip.Addr.As4.
func LPMKeyV4From(p netip.Prefix) LPMKeyV4 {
	addr, bits := p.Addr(), p.Bits()
	if addr.Is4In6() && bits >= 96 {
		addr, bits = addr.Unmap(), bits-96
	}
	if !addr.Is4() || bits < 0 {
		panic(fmt.Sprintf("bpf: LPMKeyV4From: %v is not a valid IPv4 prefix", p))
	}
	p = netip.PrefixFrom(addr, bits).Masked()
	return LPMKeyV4{Prefixlen: uint32(bits), Addr: p.Addr().As4()}
}

// Prefix returns the prefix the key stands for.
func (k masqLpmV4Key) Prefix() netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4(k.Addr), int(k.Prefixlen))
}

// String returns the key in CIDR notation, so that errors name the entry,
// even one the kernel refuses (10.0.0.0/33).
func (k masqLpmV4Key) String() string {
	return netip.AddrFrom4(k.Addr).String() + "/" + strconv.FormatUint(uint64(k.Prefixlen), 10)
}

// LPMKeyV6From returns the key for an IPv6 prefix, with host bits cleared.
// It panics if p is not a valid IPv6 prefix (IPv4-mapped IPv6 is accepted
// as is), like netip.Addr.As16 would for an invalid address.
func LPMKeyV6From(p netip.Prefix) LPMKeyV6 {
	if !p.IsValid() || !p.Addr().Is6() {
		panic(fmt.Sprintf("bpf: LPMKeyV6From: %v is not a valid IPv6 prefix", p))
	}
	p = p.Masked()
	return LPMKeyV6{Prefixlen: uint32(p.Bits()), Addr: p.Addr().As16()}
}

// Prefix returns the prefix the key stands for.
func (k masqLpmV6Key) Prefix() netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom16(k.Addr), int(k.Prefixlen))
}

// String returns the key in CIDR notation, so that errors name the entry,
// even one the kernel refuses.
func (k masqLpmV6Key) String() string {
	return netip.AddrFrom16(k.Addr).String() + "/" + strconv.FormatUint(uint64(k.Prefixlen), 10)
}
