package egressrules

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/tables"
)

func rows(spec ...string) []*tables.NonMasqCIDR {
	var out []*tables.NonMasqCIDR
	for _, s := range spec {
		action := tables.ActionNoMasquerade
		if p, ok := strings.CutPrefix(s, "masq:"); ok {
			s, action = p, tables.ActionMasquerade
		}
		out = append(out, &tables.NonMasqCIDR{Prefix: netip.MustParsePrefix(s), Action: action})
	}
	return out
}

func render(eps []*tables.Endpoint, cidrs []*tables.NonMasqCIDR, base uint32) []string {
	v4, v6, _ := templates(cidrs, base)
	var out []string
	for k := range desired(eps, v4, v6) {
		out = append(out, k.String())
	}
	slices.Sort(out)
	return out
}

func TestDesiredRules(t *testing.T) {
	ep := &tables.Endpoint{IP: netip.MustParseAddr("10.112.49.248"), RouteTable: 11}
	ep6 := &tables.Endpoint{IP: netip.MustParseAddr("fd00::5"), RouteTable: 12}
	noTable := &tables.Endpoint{IP: netip.MustParseAddr("10.112.49.249")}
	for _, tc := range []struct {
		name  string
		eps   []*tables.Endpoint
		cidrs []*tables.NonMasqCIDR
		want  []string
	}{{
		name:  "the issue's example: one rule per no-masquerade prefix",
		eps:   []*tables.Endpoint{ep, noTable},
		cidrs: rows("10.0.0.0/8", "172.16.0.0/12", "100.64.0.0/10", "192.168.0.0/16", "169.254.0.0/16", "fe80::/10"),
		want: []string{
			"111: from 10.112.49.248/32 to 10.0.0.0/8 lookup 11",
			"111: from 10.112.49.248/32 to 100.64.0.0/10 lookup 11",
			"111: from 10.112.49.248/32 to 169.254.0.0/16 lookup 11",
			"111: from 10.112.49.248/32 to 172.16.0.0/12 lookup 11",
			"111: from 10.112.49.248/32 to 192.168.0.0/16 lookup 11",
		},
	}, {
		name:  "families stay apart",
		eps:   []*tables.Endpoint{ep, ep6},
		cidrs: rows("10.0.0.0/8", "fd00::/8"),
		want: []string{
			"111: from 10.112.49.248/32 to 10.0.0.0/8 lookup 11",
			"111: from fd00::5/128 to fd00::/8 lookup 12",
		},
	}, {
		name:  "an exception inside a range goes to the main table, preferred",
		eps:   []*tables.Endpoint{ep},
		cidrs: rows("10.0.0.0/8", "masq:10.96.0.0/12"),
		want: []string{
			"110: from 10.112.49.248/32 to 10.96.0.0/12 lookup 254",
			"111: from 10.112.49.248/32 to 10.0.0.0/8 lookup 11",
		},
	}, {
		name:  "a range inside an exception goes back to the endpoint table, more preferred",
		eps:   []*tables.Endpoint{ep},
		cidrs: rows("10.0.0.0/8", "masq:10.96.0.0/12", "10.96.1.0/24"),
		want: []string{
			"109: from 10.112.49.248/32 to 10.96.1.0/24 lookup 11",
			"110: from 10.112.49.248/32 to 10.96.0.0/12 lookup 254",
			"111: from 10.112.49.248/32 to 10.0.0.0/8 lookup 11",
		},
	}, {
		name:  "prefixes that decide like their parent and top-level exceptions get no rule",
		eps:   []*tables.Endpoint{ep},
		cidrs: rows("10.0.0.0/8", "10.1.0.0/16", "masq:203.0.113.0/24"),
		want:  []string{"111: from 10.112.49.248/32 to 10.0.0.0/8 lookup 11"},
	}, {
		name:  "no endpoints with a table: no rules",
		eps:   []*tables.Endpoint{noTable},
		cidrs: rows("10.0.0.0/8"),
		want:  nil,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got := render(tc.eps, tc.cidrs, 111)
			if !slices.Equal(got, tc.want) {
				t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

func TestTemplatesDepthBeyondPriority(t *testing.T) {
	var spec []string
	for i := 8; i <= 12; i++ {
		action := ""
		if i%2 == 1 {
			action = "masq:"
		}
		spec = append(spec, fmt.Sprintf("%s10.0.0.0/%d", action, i))
	}
	_, _, errs := templates(rows(spec...), 3)
	if len(errs) == 0 {
		t.Fatal("nesting deeper than the priority allows must be reported")
	}
}

// TestDesiredMemoryFollowsRules pins the crash-loop fix: endpoints without a
// route table get no rules, so they must cost no memory whatever the number
// of prefixes. Sizing the result by endpoints × prefixes allocated about
// 1.3 GB here (1 000 endpoints × 16 384 prefixes), and the agent ran out of
// its container's memory on every endpoint change.
func TestDesiredMemoryFollowsRules(t *testing.T) {
	var cidrs []*tables.NonMasqCIDR
	for i := range 16384 {
		cidrs = append(cidrs, &tables.NonMasqCIDR{
			Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24),
			Action: tables.ActionNoMasquerade,
		})
	}
	v4, v6, errs := templates(cidrs, 111)
	if len(errs) > 0 || len(v4) != 16384 {
		t.Fatalf("templates: %d v4 templates, errors %v", len(v4), errs)
	}
	var eps []*tables.Endpoint
	for i := range 1000 {
		eps = append(eps, &tables.Endpoint{IP: netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)})})
	}
	// One endpoint with a table: exactly its 16 384 rules are needed.
	eps = append(eps, &tables.Endpoint{IP: netip.MustParseAddr("10.245.0.1"), RouteTable: 11})

	var got map[tables.IPRuleKey]struct{}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	got = desired(eps, v4, v6)
	runtime.ReadMemStats(&after)
	if len(got) != 16384 {
		t.Fatalf("desired: %d rules, want 16384", len(got))
	}
	// A map of 16 384 rules takes a few MiB; endpoints × prefixes would
	// take over a GiB. 64 MiB separates the two by an order of magnitude
	// either way.
	const limit = 64 << 20
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > limit {
		t.Fatalf("desired allocated %d MiB for 16 384 rules (limit %d MiB): sized by endpoints × prefixes?", alloc>>20, limit>>20)
	}
}

// TestTemplatesMatchAncestorProbe compares the one-pass nesting walk with
// the definition (count the table prefixes strictly containing each one, by
// probing every shorter length) on random nested prefixes of both families.
func TestTemplatesMatchAncestorProbe(t *testing.T) {
	rng := rand.New(rand.NewPCG(14, 1))
	for round := range 50 {
		seen := map[netip.Prefix]bool{}
		var cidrs []*tables.NonMasqCIDR
		for range 300 {
			var a netip.Addr
			if rng.IntN(2) == 0 {
				a = netip.AddrFrom4([4]byte{10, byte(rng.IntN(3)), byte(rng.IntN(3)), byte(rng.IntN(256))})
			} else {
				a = netip.AddrFrom16([16]byte{0xfd, byte(rng.IntN(3)), 15: byte(rng.IntN(256))})
			}
			p, _ := a.Prefix(rng.IntN(a.BitLen() + 1))
			if !seen[p] {
				seen[p] = true
				cidrs = append(cidrs, &tables.NonMasqCIDR{Prefix: p, Action: tables.Action(rng.IntN(2))})
			}
		}
		base := uint32(2 + rng.IntN(8)) // small enough that some nest too deep
		actions := cidrActions(cidrs)
		want := map[template]bool{}
		wantErrs := 0
		for _, r := range cidrs {
			depth, parent, found := 0, tables.Action(0), false
			for bits := r.Prefix.Bits() - 1; bits >= 0; bits-- {
				q, _ := r.Prefix.Addr().Prefix(bits)
				if seen[q] {
					if !found {
						parent, found = actions[q], true
					}
					depth++
				}
			}
			switch {
			case !found && r.Action == tables.ActionMasquerade, found && parent == r.Action:
			case uint32(depth) >= base:
				wantErrs++
			default:
				want[template{priority: base - uint32(depth), to: r.Prefix, main: r.Action == tables.ActionMasquerade}] = true
			}
		}
		v4, v6, errs := templates(cidrs, base)
		got := map[template]bool{}
		for _, tm := range slices.Concat(v4, v6) {
			got[tm] = true
			if tm.to.Addr().Is4() != slices.Contains(v4, tm) {
				t.Fatalf("round %d: %v in the wrong family", round, tm)
			}
		}
		if !maps.Equal(got, want) || len(errs) != wantErrs || len(v4)+len(v6) != len(got) {
			t.Fatalf("round %d (base %d): %d templates, %d errors; want %d templates, %d errors", round, base, len(got), len(errs), len(want), wantErrs)
		}
	}
}

func cidrActions(cidrs []*tables.NonMasqCIDR) map[netip.Prefix]tables.Action {
	m := map[netip.Prefix]tables.Action{}
	for _, c := range cidrs {
		m[c.Prefix] = c.Action
	}
	return m
}
