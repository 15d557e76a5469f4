package datapathtables

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/tables"
)

// Config is the datapath tables' command-line configuration.
type Config struct {
	// MasqueradePodCIDRsOnly restricts the masquerade sources to the pod
	// CIDRs (the Node's spec.podCIDRs, --pod-cidr, --cluster-cidr).
	// Without it every forwarded source but the node's own addresses is
	// masqueraded, as by the Kubernetes ip-masq-agent.
	MasqueradePodCIDRsOnly bool `mapstructure:"masquerade-pod-cidrs-only"`
}

// DefaultConfig is upstream's source semantics: every source.
var DefaultConfig = Config{}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Bool("masquerade-pod-cidrs-only", def.MasqueradePodCIDRsOnly,
		"Masquerade only traffic from the pod CIDRs (the Node's spec.podCIDRs, --pod-cidr, --cluster-cidr); "+
			"by default every forwarded source but the node's own addresses is masqueraded, as by the Kubernetes ip-masq-agent, "+
			"so pods of any CNI and IPAM (Calico blocks, ENI secondary addresses, ...) are covered")
}

// linkOnly are the sources only the node's own kernel sends from, for the
// link alone: the unspecified addresses (duplicate address detection, MLD
// reports before the device has a usable link-local address, a DHCP
// client's first messages) and the IPv6 link-local addresses. No forwarded
// packet has such a source (the kernel drops them as martians; ip6_forward
// refuses them), so none is masqueraded, nor translated by a rule,
// whatever prefix covers it: under 0.0.0.0/0 or ::/0 a DAD probe would
// leave as a solicitation from the SNAT address, with a NAT pair of its
// own. Linux never translates them either: conntrack makes no entry for
// neighbour discovery or MLD, and DHCP clients' packet sockets pass no
// netfilter hook.
var linkOnly = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/32"),
	netip.MustParsePrefix("::/128"),
	netip.MustParsePrefix("fe80::/10"),
}

// sourceEntries returns the entries of masq_src_v4/v6. masq are the
// masquerade sources (0.0.0.0/0 and ::/0, or the pod CIDRs), nodes the
// node's own addresses (never masqueraded), rules the masquerade rules'
// sources on any device. The datapath reads only the longest matching
// entry, so each entry carries the flags of every prefix that covers it:
// Masquerade when a masquerade source covers it and it is not a node
// address, Rules when a rule's source covers it; an entry inside a
// link-only prefix (linkOnly) has neither. A node address or a link-only
// prefix gets an entry only where a masquerade source or a rule covers it
// (elsewhere no entry says the same).
func sourceEntries(masq []netip.Prefix, masqOrigin tables.SourceOrigin, nodes []netip.Addr, rules []netip.Prefix) map[netip.Prefix]*tables.MasqueradeSource {
	covered := func(set []netip.Prefix, p netip.Prefix) bool {
		for _, s := range set {
			if s.Addr().Is4() == p.Addr().Is4() && s.Bits() <= p.Bits() && s.Contains(p.Addr()) {
				return true
			}
		}
		return false
	}
	out := map[netip.Prefix]*tables.MasqueradeSource{}
	for _, p := range masq {
		out[p.Masked()] = &tables.MasqueradeSource{Prefix: p.Masked(), Origin: masqOrigin}
	}
	for _, p := range rules {
		if _, ok := out[p.Masked()]; !ok {
			out[p.Masked()] = &tables.MasqueradeSource{Prefix: p.Masked(), Origin: tables.OriginMasqueradeRule}
		}
	}
	for _, a := range nodes {
		p := netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen())
		if covered(masq, p) || covered(rules, p) {
			out[p] = &tables.MasqueradeSource{Prefix: p, Origin: tables.OriginNodeAddress}
		}
	}
	for _, p := range linkOnly {
		if _, ok := out[p]; !ok && (covered(masq, p) || covered(rules, p)) {
			out[p] = &tables.MasqueradeSource{Prefix: p, Origin: tables.OriginLinkOnly}
		}
	}
	for p, e := range out {
		link := covered(linkOnly, p)
		e.Masquerade = !link && e.Origin != tables.OriginNodeAddress && covered(masq, p)
		e.Rules = !link && covered(rules, p)
	}
	return out
}

// sourcesDeriver keeps masquerade-sources equal to sourceEntries of the
// current pod CIDRs (with --masquerade-pod-cidrs-only), node addresses and
// masquerade rule sources.
type sourcesDeriver struct {
	params          params
	markInitialized func(statedb.WriteTxn)
	// logged is the summary last logged, so that a change is logged once.
	logged string
}

func (d *sourcesDeriver) run(ctx context.Context, health cell.Health) error {
	p := d.params
	for {
		txn := p.DB.ReadTxn()
		podRows, podsChanged := p.PodCIDRs.AllWatch(txn)
		addrRows, addrsChanged := p.NodeAddrs.AllWatch(txn)
		ruleRows, rulesChanged := p.RuleSources.AllWatch(txn)
		podsInit, podsInitWatch := p.PodCIDRs.Initialized(txn)
		addrsInit, addrsInitWatch := p.NodeAddrs.Initialized(txn)
		if !p.Sources.MasqueradePodCIDRsOnly {
			// the pod CIDRs do not matter: nothing to wait for
			podsInit, podsInitWatch, podsChanged = true, nil, nil
		}
		// An initialized table's watch channel is closed: waiting on it
		// would spin. (The deriver marks rule sources and node addresses
		// initialized together.)
		if podsInit {
			podsInitWatch = nil
		}
		if addrsInit {
			addrsInitWatch = nil
		}
		if podsInit && addrsInit {
			d.sync(health, statedb.Collect(podRows), statedb.Collect(addrRows), statedb.Collect(ruleRows))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-podsChanged:
		case <-addrsChanged:
		case <-rulesChanged:
		case <-podsInitWatch:
		case <-addrsInitWatch:
		}
	}
}

func (d *sourcesDeriver) sync(health cell.Health, pods []*tables.PodCIDR, addrs []*tables.NodeAddress, ruleSrcs []*tables.MasqueradeRuleSource) {
	p := d.params
	enabled := func(a netip.Addr) bool {
		return (a.Unmap().Is4() && p.Agent.EnableIPv4) || (!a.Unmap().Is4() && p.Agent.EnableIPv6)
	}
	var masq []netip.Prefix
	origin := tables.OriginEverySource
	if p.Sources.MasqueradePodCIDRsOnly {
		origin = tables.OriginPodCIDR
		for _, c := range pods {
			if enabled(c.Prefix.Addr()) {
				masq = append(masq, c.Prefix.Masked())
			}
		}
	} else {
		if p.Agent.EnableIPv4 {
			masq = append(masq, netip.MustParsePrefix("0.0.0.0/0"))
		}
		if p.Agent.EnableIPv6 {
			masq = append(masq, netip.MustParsePrefix("::/0"))
		}
	}
	var nodes []netip.Addr
	for _, a := range addrs {
		if enabled(a.Addr) {
			nodes = append(nodes, a.Addr)
		}
	}
	var rules []netip.Prefix
	for _, r := range ruleSrcs {
		if enabled(r.Source.Addr()) {
			rules = append(rules, r.Source.Masked())
		}
	}
	want := sourceEntries(masq, origin, nodes, rules)

	wtxn := p.DB.WriteTxn(p.SourceRows)
	for row := range p.SourceRows.All(wtxn) {
		if w, ok := want[row.Prefix]; ok && w.SameAs(row) {
			delete(want, row.Prefix)
		} else if !ok {
			p.SourceRows.Delete(wtxn, row)
		}
	}
	for _, row := range want {
		row.Status = reconciler.StatusPending()
		p.SourceRows.Insert(wtxn, row)
	}
	if d.markInitialized != nil {
		d.markInitialized(wtxn)
		d.markInitialized = nil
	}
	wtxn.Commit()

	summary := tables.DescribeMasqueradeSources(p.SourceRows.All(p.DB.ReadTxn()))
	if summary != d.logged {
		d.logged = summary
		p.Log.Info("Masquerade sources", "sources", summary)
	}
	if p.Sources.MasqueradePodCIDRsOnly && len(masq) == 0 {
		health.Degraded("no masquerade source", fmt.Errorf(
			"--masquerade-pod-cidrs-only is set and no pod CIDR is known (the Node's spec.podCIDRs, --pod-cidr, --cluster-cidr): "+
				"pods' traffic leaves unmasqueraded; drop the flag to masquerade every source but the node's own addresses"))
		return
	}
	health.OK(summary)
}
