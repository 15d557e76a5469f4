package netfilter

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math/bits"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
)

// IPMasqAgentChain is the chain the Kubernetes ip-masq-agent writes
// (its --masq-chain default).
const IPMasqAgentChain = "IP-MASQ-AGENT"

// Scan lists, read-only, the NAT rules of the calling thread's network
// namespace that decide before ipmasq's programs: chains named
// IP-MASQ-AGENT, and MASQUERADE or SNAT rules that match every source or a
// source overlapping one of sources (the pod CIDRs), over nftables' netlink
// API (iptables-nft rules are nftables rules). procNet is the namespace's
// /proc/net (e.g. /proc/thread-self/net): iptables-legacy's tables are not
// on that API, so only the presence of a legacy nat table is reported, from
// ip_tables_names and ip6_tables_names.
func Scan(procNet string, sources []netip.Prefix) ([]*tables.NetfilterNATRule, error) {
	conn, err := nftables.New()
	if err != nil {
		return nil, fmt.Errorf("nftables netlink: %w", err)
	}
	out, err := scanNftables(conn, sources)
	if err != nil {
		return nil, err
	}
	legacy, err := scanLegacy(procNet)
	if err != nil {
		return nil, err
	}
	return append(out, legacy...), nil
}

func scanNftables(conn *nftables.Conn, sources []netip.Prefix) ([]*tables.NetfilterNATRule, error) {
	chains, err := conn.ListChains()
	if errors.Is(err, unix.ENOENT) {
		return nil, nil // nf_tables not loaded: nothing there
	}
	if err != nil {
		return nil, fmt.Errorf("list nftables chains: %w", err)
	}
	var out []*tables.NetfilterNATRule
	for _, c := range chains {
		fam := familyName(c.Table.Family)
		if fam == "" {
			continue // arp, bridge, netdev: no IP NAT
		}
		if c.Name == IPMasqAgentChain {
			out = append(out, &tables.NetfilterNATRule{Family: fam, Table: c.Table.Name, Chain: c.Name, Kind: tables.NetfilterIPMasqAgentChain})
		}
		rules, err := conn.GetRules(c.Table, c)
		if err != nil {
			return nil, fmt.Errorf("list rules of %s %s %s: %w", fam, c.Table.Name, c.Name, err)
		}
		// markGated: an earlier rule of the chain returned every packet
		// without (or with) a mark, so the rest only sees marked packets:
		// kube-proxy's KUBE-POSTROUTING ("-m mark ! --mark 0x4000/0x4000
		// -j RETURN", then MASQUERADE) masquerades only the Service
		// traffic it marked, never a pod's own.
		markGated := false
		for _, r := range rules {
			kind, match, marked, returns := classify(r.Exprs, c.Table.Family)
			if marked && returns {
				markGated = true
			}
			if kind == "" || marked || markGated || !decidesFor(match, sources) {
				continue
			}
			out = append(out, &tables.NetfilterNATRule{
				Family: fam, Table: c.Table.Name, Chain: c.Name, Handle: r.Handle, Kind: kind, Sources: match.String(),
			})
		}
	}
	return out, nil
}

func familyName(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyIPv4:
		return "ip"
	case nftables.TableFamilyIPv6:
		return "ip6"
	case nftables.TableFamilyINet:
		return "inet"
	}
	return ""
}

// sourceMatch is a rule's match on the source address.
type sourceMatch struct {
	// any: the rule has no source match.
	any    bool
	prefix netip.Prefix
	negate bool
}

func (m sourceMatch) String() string {
	switch {
	case m.any:
		return "any"
	case m.negate:
		return "not " + m.prefix.String()
	}
	return m.prefix.String()
}

// classify returns the rule's NAT kind ("" when it neither masquerades nor
// SNATs), its source match, whether it is conditioned on a packet or
// connection mark, and whether its verdict is RETURN. iptables-nft writes
// "-s" as a payload load of the source address (only the bytes the prefix
// covers), an optional bitwise mask and a comparison, "-m mark" as a meta
// mark load, and MASQUERADE/SNAT as xtables targets; native nftables rules
// use masq and nat expressions.
func classify(exprs []expr.Any, family nftables.TableFamily) (kind tables.NetfilterNATKind, match sourceMatch, marked, returns bool) {
	match = sourceMatch{any: true}
	var load *expr.Payload
	var mask []byte
	for _, e := range exprs {
		switch e := e.(type) {
		case *expr.Target:
			switch e.Name {
			case "MASQUERADE":
				kind = tables.NetfilterMasquerade
			case "SNAT":
				kind = tables.NetfilterSNAT
			}
		case *expr.Match:
			if e.Name == "mark" || e.Name == "connmark" {
				marked = true
			}
		case *expr.Meta:
			if e.Key == expr.MetaKeyMARK && !e.SourceRegister {
				marked = true
			}
		case *expr.Ct:
			if e.Key == expr.CtKeyMARK && !e.SourceRegister {
				marked = true
			}
		case *expr.Verdict:
			returns = e.Kind == expr.VerdictReturn
		case *expr.Masq:
			kind = tables.NetfilterMasquerade
		case *expr.NAT:
			if e.Type == expr.NATTypeSourceNAT {
				kind = tables.NetfilterSNAT
			}
		case *expr.Payload:
			load, mask = nil, nil
			if e.OperationType == expr.PayloadLoad && e.Base == expr.PayloadBaseNetworkHeader && isSourceField(e, family) {
				load = e
			}
		case *expr.Bitwise:
			if load != nil {
				mask = e.Mask
			}
		case *expr.Cmp:
			if load == nil {
				continue
			}
			if p, ok := prefixOf(load, mask, e.Data); ok && (e.Op == expr.CmpOpEq || e.Op == expr.CmpOpNeq) {
				match = sourceMatch{prefix: p, negate: e.Op == expr.CmpOpNeq}
			}
			load, mask = nil, nil
		}
	}
	return kind, match, marked, returns
}

// isSourceField: the IPv4 source is at offset 12 (4 bytes), the IPv6 source
// at 8 (16 bytes); a prefix load reads its first bytes only. In the inet
// family both are possible: the length tells them apart where it can.
func isSourceField(p *expr.Payload, family nftables.TableFamily) bool {
	v4 := p.Offset == 12 && p.Len >= 1 && p.Len <= 4
	v6 := p.Offset == 8 && p.Len >= 1 && p.Len <= 16
	switch family {
	case nftables.TableFamilyIPv4:
		return v4
	case nftables.TableFamilyIPv6:
		return v6
	}
	return v4 || v6
}

// prefixOf turns a load of the first len bytes of the source address, its
// mask (nil: all bits) and the compared value into a prefix.
func prefixOf(load *expr.Payload, mask, data []byte) (netip.Prefix, bool) {
	size := 4
	if load.Offset == 8 {
		size = 16
	}
	if len(data) != int(load.Len) {
		return netip.Prefix{}, false
	}
	addr := make([]byte, size)
	copy(addr, data)
	n := len(data) * 8
	if mask != nil {
		n = 0
		for _, b := range mask {
			n += bits.OnesCount8(b)
		}
	}
	a, ok := netip.AddrFromSlice(addr)
	if !ok {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, n).Masked(), true
}

// decidesFor: a rule matching every source, or a source overlapping a
// masquerade source, decides (some of) ipmasq's traffic. A negated match
// decides for every source outside its prefix, so it counts unless the
// prefix covers every masquerade source.
func decidesFor(m sourceMatch, sources []netip.Prefix) bool {
	if m.any {
		return true
	}
	for _, s := range sources {
		if s.Addr().Is4() != m.prefix.Addr().Is4() {
			continue
		}
		covered := m.prefix.Bits() <= s.Bits() && m.prefix.Contains(s.Addr())
		if m.negate && !covered || !m.negate && m.prefix.Overlaps(s) {
			return true
		}
	}
	return false
}

// scanLegacy reports the iptables-legacy nat tables of the namespace whose
// /proc/net is procNet.
func scanLegacy(procNet string) ([]*tables.NetfilterNATRule, error) {
	var out []*tables.NetfilterNATRule
	for _, f := range []struct{ file, family string }{{"ip_tables_names", "legacy-ipv4"}, {"ip6_tables_names", "legacy-ipv6"}} {
		data, err := os.ReadFile(filepath.Join(procNet, f.file))
		if errors.Is(err, fs.ErrNotExist) {
			continue // the legacy modules are not loaded
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", filepath.Join(procNet, f.file), err)
		}
		if slices.Contains(strings.Fields(string(bytes.TrimSpace(data))), "nat") {
			out = append(out, &tables.NetfilterNATRule{Family: f.family, Table: "nat", Kind: tables.NetfilterLegacyNATTable})
		}
	}
	return out, nil
}
