package egressrules

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	"github.com/ipmasq/ipmasq/tables"
)

// template is the part of a rule shared by every endpoint of a family.
type template struct {
	priority uint32
	to       netip.Prefix
	// main sends the traffic to the main table instead of the endpoint's.
	main bool
}

// templates computes the per-family rule templates from the prefixes and
// actions of nonmasq-cidrs. Prefixes nested too deep for the priority
// range are reported in errs and get no rule.
//
// One pass over the prefixes sorted by address, then length, with a stack
// of the prefixes that contain the current one: a prefix's ancestors all
// sort before it, and a prefix popped from the stack contains none of the
// later ones. (Probing a map once per shorter length cost 24 lookups per
// IPv4 prefix and was a sixth of the agent's CPU at 16 384 prefixes.)
func templates(rows []*tables.NonMasqCIDR, base uint32) (v4, v6 []template, errs []error) {
	sorted := slices.Clone(rows)
	slices.SortFunc(sorted, func(a, b *tables.NonMasqCIDR) int { return comparePrefix(a.Prefix, b.Prefix) })
	n4 := 0
	for _, r := range rows {
		if r.Prefix.Addr().Is4() {
			n4++
		}
	}
	v4, v6 = make([]template, 0, n4), make([]template, 0, len(rows)-n4)
	var stack []*tables.NonMasqCIDR
	for _, r := range sorted {
		for len(stack) > 0 && !contains(stack[len(stack)-1].Prefix, r.Prefix) {
			stack = stack[:len(stack)-1]
		}
		depth := len(stack)
		stack = append(stack, r)
		if depth == 0 && r.Action == tables.ActionMasquerade {
			continue // masqueraded anyway: the main table is the default
		}
		if depth > 0 && stack[depth-1].Action == r.Action {
			continue // the parent's rule already decides the same
		}
		if uint32(depth) >= base {
			errs = append(errs, fmt.Errorf("%s is nested %d deep, more than --egress-rule-priority=%d leaves room for", r.Prefix, depth, base))
			continue
		}
		t := template{priority: base - uint32(depth), to: r.Prefix, main: r.Action == tables.ActionMasquerade}
		if r.Prefix.Addr().Is4() {
			v4 = append(v4, t)
		} else {
			v6 = append(v6, t)
		}
	}
	return v4, v6, errs
}

// comparePrefix orders prefixes by address, then length.
func comparePrefix(p, q netip.Prefix) int {
	if c := p.Addr().Compare(q.Addr()); c != 0 {
		return c
	}
	return cmp.Compare(p.Bits(), q.Bits())
}

// contains reports whether p strictly contains q.
func contains(p, q netip.Prefix) bool {
	return p.Bits() < q.Bits() && p.Contains(q.Addr())
}

// desired computes every rule for the endpoints that have a route table.
// The result is sized by the rules that will exist, never by endpoints ×
// prefixes: endpoints without a route table get no rules, and with 16 384
// prefixes per family sizing by every endpoint cost gigabytes.
func desired(eps []*tables.Endpoint, v4, v6 []template) map[tables.IPRuleKey]struct{} {
	n := 0
	for _, ep := range eps {
		if ep.RouteTable == 0 {
			continue
		}
		if ep.Family() == tables.IPv6 {
			n += len(v6)
		} else {
			n += len(v4)
		}
	}
	out := make(map[tables.IPRuleKey]struct{}, n)
	for _, ep := range eps {
		if ep.RouteTable == 0 {
			continue
		}
		ts := v4
		if ep.Family() == tables.IPv6 {
			ts = v6
		}
		from := netip.PrefixFrom(ep.IP, ep.IP.BitLen())
		for _, t := range ts {
			table := ep.RouteTable
			if t.main {
				table = tables.MainRouteTable
			}
			out[tables.IPRuleKey{Priority: t.priority, From: from, To: t.to, Table: table}] = struct{}{}
		}
	}
	return out
}
