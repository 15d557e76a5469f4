package iprules

import (
	"fmt"
	"net/netip"

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
func templates(rows []*tables.NonMasqCIDR, base uint32) (v4, v6 []template, errs []error) {
	byPrefix := make(map[netip.Prefix]tables.Action, len(rows))
	for _, r := range rows {
		byPrefix[r.Prefix] = r.Action
	}
	for _, r := range rows {
		depth, parent, hasParent := ancestors(byPrefix, r.Prefix)
		if !hasParent && r.Action == tables.ActionMasquerade {
			continue // masqueraded anyway: the main table is the default
		}
		if hasParent && parent == r.Action {
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

// ancestors counts the table prefixes strictly containing p and returns the
// action of the nearest (longest) one.
func ancestors(byPrefix map[netip.Prefix]tables.Action, p netip.Prefix) (depth int, nearest tables.Action, found bool) {
	for bits := p.Bits() - 1; bits >= 0; bits-- {
		q, _ := p.Addr().Prefix(bits)
		if a, ok := byPrefix[q]; ok {
			if !found {
				nearest, found = a, true
			}
			depth++
		}
	}
	return depth, nearest, found
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
