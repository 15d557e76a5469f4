package datapathtables

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/tables"
)

// lookup is what the datapath does with masq_src: the longest entry that
// holds a decides alone (nil: no entry).
func lookup(entries map[netip.Prefix]*tables.MasqueradeSource, a netip.Addr) *tables.MasqueradeSource {
	var best *tables.MasqueradeSource
	for p, e := range entries {
		if p.Contains(a) && (best == nil || p.Bits() > best.Prefix.Bits()) {
			best = e
		}
	}
	return best
}

func TestSourceEntries(t *testing.T) {
	pfx := func(ss ...string) (out []netip.Prefix) {
		for _, s := range ss {
			out = append(out, netip.MustParsePrefix(s))
		}
		return out
	}
	addrs := func(ss ...string) (out []netip.Addr) {
		for _, s := range ss {
			out = append(out, netip.MustParseAddr(s))
		}
		return out
	}
	type want struct {
		addr        string
		masq, rules bool
	}
	for _, c := range []struct {
		name   string
		masq   []netip.Prefix
		origin tables.SourceOrigin
		nodes  []netip.Addr
		rules  []netip.Prefix
		rows   []string // prefix/masquerade/rules/origin
		check  []want
	}{{
		name: "every source but the node's", masq: pfx("0.0.0.0/0", "::/0"), origin: tables.OriginEverySource,
		nodes: addrs("10.0.0.5", "127.0.0.1", "fd00::5"),
		rows: []string{"0.0.0.0/0 true false every-source", "0.0.0.0/32 false false link-only", "10.0.0.5/32 false false node-address",
			"127.0.0.1/32 false false node-address", "::/0 true false every-source", "::/128 false false link-only",
			"fd00::5/128 false false node-address", "fe80::/10 false false link-only"},
		check: []want{{"10.244.1.5", true, false}, {"192.168.6.1", true, false}, {"10.0.0.5", false, false}, {"10.0.0.6", true, false}, {"fd00::6", true, false}, {"fd00::5", false, false},
			// the node's own, for the link alone: DHCP, DAD and MLD from
			// the unspecified address, neighbour discovery from a
			// link-local one (in node-addresses or not yet)
			{"0.0.0.0", false, false}, {"::", false, false}, {"fe80::1", false, false}, {"febf::1", false, false},
			{"fec0::1", true, false}, {"0.0.0.1", true, false}, {"::1:0", true, false}},
	}, {
		name: "rules cover the link-only sources too", masq: pfx("0.0.0.0/0", "::/0"), origin: tables.OriginEverySource,
		nodes: addrs("fe80::5"), rules: pfx("0.0.0.0/0", "::/0", "fe80::/64"),
		rows: []string{"0.0.0.0/0 true true every-source", "0.0.0.0/32 false false link-only", "::/0 true true every-source",
			"::/128 false false link-only", "fe80::/10 false false link-only", "fe80::/64 false false masquerade-rule", "fe80::5/128 false false node-address"},
		check: []want{{"10.244.1.5", true, true}, {"0.0.0.0", false, false}, {"::", false, false}, {"fe80::5", false, false}, {"fe80::6", false, false}, {"fe80:1::6", false, false}, {"2001:db8::1", true, true}},
	}, {
		name: "rules inside and around", masq: pfx("0.0.0.0/0"), origin: tables.OriginEverySource,
		nodes: addrs("10.0.0.5"), rules: pfx("192.168.6.0/24", "10.0.0.0/8"),
		rows: []string{"0.0.0.0/0 true false every-source", "0.0.0.0/32 false false link-only", "10.0.0.0/8 true true masquerade-rule",
			"10.0.0.5/32 false true node-address", "192.168.6.0/24 true true masquerade-rule"},
		check: []want{{"192.168.6.1", true, true}, {"192.168.7.1", true, false}, {"10.0.0.5", false, true}, {"10.9.9.9", true, true}, {"0.0.0.0", false, false}},
	}, {
		name: "pod CIDRs only", masq: pfx("10.244.1.0/24"), origin: tables.OriginPodCIDR,
		// the bridge's address is in the pod CIDR; the uplink's is not
		nodes: addrs("10.244.1.1", "10.0.0.5"), rules: pfx("192.168.6.0/24", "10.244.0.0/16"),
		rows: []string{"10.244.0.0/16 false true masquerade-rule", "10.244.1.0/24 true true pod-cidr",
			"10.244.1.1/32 false true node-address", "192.168.6.0/24 false true masquerade-rule"},
		check: []want{{"10.244.1.5", true, true}, {"10.244.2.5", false, true}, {"10.244.1.1", false, true}, {"10.0.0.5", false, false}, {"172.16.0.1", false, false}, {"192.168.6.9", false, true}},
	}, {
		name: "pod CIDRs only, none known", origin: tables.OriginPodCIDR, nodes: addrs("10.0.0.5"),
		check: []want{{"10.0.0.5", false, false}, {"10.244.1.5", false, false}},
	}} {
		t.Run(c.name, func(t *testing.T) {
			got := sourceEntries(c.masq, c.origin, c.nodes, c.rules)
			var rows []string
			for _, e := range got {
				rows = append(rows, strings.Join(e.TableRow()[:4], " "))
			}
			slices.Sort(rows)
			if !slices.Equal(rows, c.rows) {
				t.Errorf("entries:\n got %q\nwant %q", rows, c.rows)
			}
			for _, w := range c.check {
				e := lookup(got, netip.MustParseAddr(w.addr))
				masq, rules := e != nil && e.Masquerade, e != nil && e.Rules
				if masq != w.masq || rules != w.rules {
					t.Errorf("%s: masquerade %v rules %v, want %v %v", w.addr, masq, rules, w.masq, w.rules)
				}
			}
		})
	}
}
