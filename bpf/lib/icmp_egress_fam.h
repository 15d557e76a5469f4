/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * ICMP errors on egress (icmp_egress.h) for one family: a template,
 * included once with FAMILY 4 and once with FAMILY 6 (see family.h), after
 * the headers it uses.
 *
 * Defines: icmp_error_unmatched_v4, icmp_error_unmatched_v6,
 * egress_icmp_error_v4, egress_icmp_error_v6.
 */

#include "family.h"

/* icmp_error_unmatched_v4/v6: see icmp_error_unmatched. A subprogram of
 * its own keeps decide_*'s stack out of the callers' frames. */
static __noinline int FAM(icmp_error_unmatched)(struct __sk_buff *skb, const struct pkt *p,
						const struct masq_rule *rule)
{
	FAM_ADDR snat;

	return icmp_error_unmatched(FAM(decide)(skb, p, rule, &snat));
}

/* egress_icmp_error_v4/v6 return the tc action for an ICMP error about a
 * translated flow, or NOT_TRANSLATED_ERROR. */
static __noinline int FAM(egress_icmp_error)(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 inner_off = p->l4_off + 8, inner_l4, port_off, diff = 0;
	__u32 icmp_csum = p->l4_off + 2;
	FAM_T(nat, key) k = { .dir = DIR_EGRESS };
	const struct masq_rule *rule;
	FAM_T(nat, val) *v;
	FAM_ADDR from, to, src;
	int from_source;
	__be16 pto;
	__u8 type;

	if (bpf_skb_load_bytes(skb, p->l4_off, &type, 1) < 0 || !FAM(is_icmp_error)(type))
		return NOT_TRANSLATED_ERROR;
	from_source = FAM(masq_source)(skb, FAM_PKT(p).saddr, &rule);
	inner_l4 = FAM(icmp_quote)(skb, inner_off, FAM_PKT(p).daddr, &k);
	if (!inner_l4)
		goto unmatched;
	if (quote_egress_ports(skb, k.proto, inner_l4, &k.sport, &k.dport, &port_off) < 0)
		goto unmatched;
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (!v) {
		/* A pod's error about a flow a remote opened (port unreachable
		 * for its probe) passes untranslated, as Linux passes it: the
		 * flow is the remote's, the pod answers from its own address. */
		k.dir = DIR_INBOUND;
		if (from_source && bpf_map_lookup_elem(&FAM(nat), &k)) {
			count(COUNTER_SKIP_INBOUND_REPLY);
			return TC_ACT_UNSPEC;
		}
		goto unmatched;
	}
	FAM_ADDR_COPY(from, k.src);
	FAM_ADDR_COPY(to, v->addr);
	pto = v->port;
	/* ICMPv4 quotes have no pseudo header; ICMPv6 quotes and the rest do */
	if (FAM_IS_V6 || k.proto != IPPROTO_ICMP)
		diff = bpf_csum_diff((__be32 *)FAM_PTR(from), FAM_ADDR_LEN, (__be32 *)FAM_PTR(to),
				     FAM_ADDR_LEN, 0);

	/* a pod's own error leaves from the flow's SNAT address (for ICMPv6
	 * the outer source is in the pseudo header) */
	if (from_source) {
		FAM_ADDR_COPY(src, FAM_PKT(p).saddr);
		if (FAM_REWRITE(skb, p, saddr, src, to, ICMP_FAM_PROTO, icmp_csum, 0, 0, 0) < 0)
			goto err;
	}
	/* quoted destination */
	if (FAM(icmp_quote_addr)(skb, icmp_csum, inner_off, ICMP_FAM_IPHDR_OFF(inner_off, daddr),
				 from, to, diff) < 0)
		goto err;
	if (icmp_quote_port(skb, icmp_csum, k.proto, inner_l4, port_off, k.sport, pto, diff) < 0)
		goto err;
	count(COUNTER_ICMP_ERR_EGRESS);
	return TC_ACT_UNSPEC;
unmatched:
	return NOT_TRANSLATED_ERROR;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

#undef FAMILY
#include "family.h"
