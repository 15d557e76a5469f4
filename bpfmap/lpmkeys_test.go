package bpfmap

import (
	"fmt"
	"net/netip"
	"strconv"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// The generic library is tested on LPM tries, with keys of the same layout
// as bpf/lib/types.h's struct lpm_v4_key/lpm_v6_key. The agent's own keys are
// bpf.LPMKeyV4/V6, bpf2go's types; these are the tests' (bpfmap cannot
// import bpf, which imports it).

// LPMKeyV4 is the key of an IPv4 LPM trie, laid out like the C struct
// `struct { __u32 prefixlen; __u8 addr[4]; }`: PrefixLen in host byte order,
// Addr in network byte order.
type LPMKeyV4 struct {
	PrefixLen uint32
	Addr      [4]byte
}

// LPMKeyV6 is the key of an IPv6 LPM trie, laid out like the C struct
// `struct { __u32 prefixlen; __u8 addr[16]; }`: PrefixLen in host byte order,
// Addr in network byte order.
type LPMKeyV6 struct {
	PrefixLen uint32
	Addr      [16]byte
}

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
		panic(fmt.Sprintf("bpfmap: LPMKeyV4From: %v is not a valid IPv4 prefix", p))
	}
	p = netip.PrefixFrom(addr, bits).Masked()
	return LPMKeyV4{PrefixLen: uint32(bits), Addr: p.Addr().As4()}
}

// Prefix returns the prefix the key stands for.
func (k LPMKeyV4) Prefix() netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4(k.Addr), int(k.PrefixLen))
}

// String returns the key in CIDR notation, so that errors name the entry,
// even one the kernel refuses (10.0.0.0/33).
func (k LPMKeyV4) String() string {
	return netip.AddrFrom4(k.Addr).String() + "/" + strconv.FormatUint(uint64(k.PrefixLen), 10)
}

// LPMKeyV6From returns the key for an IPv6 prefix, with host bits cleared.
// It panics if p is not a valid IPv6 prefix (IPv4-mapped IPv6 is accepted
// as is), like netip.Addr.As16 would for an invalid address.
func LPMKeyV6From(p netip.Prefix) LPMKeyV6 {
	if !p.IsValid() || !p.Addr().Is6() {
		panic(fmt.Sprintf("bpfmap: LPMKeyV6From: %v is not a valid IPv6 prefix", p))
	}
	p = p.Masked()
	return LPMKeyV6{PrefixLen: uint32(p.Bits()), Addr: p.Addr().As16()}
}

// Prefix returns the prefix the key stands for.
func (k LPMKeyV6) Prefix() netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom16(k.Addr), int(k.PrefixLen))
}

// String returns the key in CIDR notation, so that errors name the entry,
// even one the kernel refuses.
func (k LPMKeyV6) String() string {
	return netip.AddrFrom16(k.Addr).String() + "/" + strconv.FormatUint(uint64(k.PrefixLen), 10)
}

// LPMTrieSpec describes an LPM trie map. The kernel refuses LPM tries without
// BPF_F_NO_PREALLOC, so the flag is always set. keySize is 8 for [LPMKeyV4]
// and 20 for [LPMKeyV6].
func LPMTrieSpec(name string, keySize uint32, valueSize uint32, maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       name,
		Type:       ebpf.LPMTrie,
		KeySize:    keySize,
		ValueSize:  valueSize,
		MaxEntries: maxEntries,
		Flags:      unix.BPF_F_NO_PREALLOC,
	}
}

// The kernel agrees with the layout: a lookup of a host address finds its
// longest matching prefix.
func TestLPMTrieLongestMatch(t *testing.T) {
	m := newLPMv4(t, 8)
	c := newCache(t, m)
	noErrors(t, c.Put([]KV[LPMKeyV4, uint8]{
		{key4("10.0.0.0/8"), 0},
		{key4("10.1.0.0/16"), 1},
	}))
	for addr, want := range map[string]uint8{"10.1.2.3": 1, "10.2.0.1": 0} {
		var got uint8
		if err := m.Lookup(key4(addr+"/32"), &got); err != nil {
			t.Fatalf("lookup %s: %v", addr, err)
		}
		if got != want {
			t.Errorf("lookup %s = %d, want %d", addr, got, want)
		}
	}
}
