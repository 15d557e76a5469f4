/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * ICMP errors on ingress (icmp.h) for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: icmp_error_v4, icmp_error_v6.
 */

#include "family.h"

/* icmp_error_v4/v6 translate an ICMP error about a translated flow back to
 * the flow's source (see icmp.h); any other passes as it is. */
static __noinline int FAM(icmp_error)(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 inner_off = p->l4_off + 8, inner_l4, port_off, diff = 0;
	__u32 icmp_csum = p->l4_off + 2;
	FAM_T(nat, key) k = { .dir = DIR_INGRESS };
	FAM_T(nat, val) *v;
	FAM_ADDR from, to;
	__be16 pfrom;

	inner_l4 = FAM(icmp_quote)(skb, inner_off, FAM_PKT(p).daddr, &k);
	if (!inner_l4)
		return TC_ACT_UNSPEC;
	if (icmp_inner_ports(skb, k.proto, inner_l4, &k.sport, &k.dport, &port_off) < 0)
		return TC_ACT_UNSPEC;
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (!v)
		return TC_ACT_UNSPEC;
	FAM_ADDR_COPY(from, k.dst);
	FAM_ADDR_COPY(to, v->addr);
	pfrom = k.dport;
	/* ICMPv4 quotes have no pseudo header; ICMPv6 quotes and the rest do */
	if (FAM_IS_V6 || k.proto != IPPROTO_ICMP)
		diff = bpf_csum_diff((__be32 *)FAM_PTR(from), FAM_ADDR_LEN, (__be32 *)FAM_PTR(to),
				     FAM_ADDR_LEN, 0);

	/* outer destination: the IPv4 header checksum, the ICMPv6 pseudo header */
	if (FAM_REWRITE(skb, p, daddr, from, to, ICMP_FAM_PROTO, icmp_csum, 0, 0, 0) < 0)
		goto err;
	/* quoted source */
	if (FAM(icmp_quote_addr)(skb, icmp_csum, inner_off, ICMP_FAM_IPHDR_OFF(inner_off, saddr),
				 from, to, diff) < 0)
		goto err;
	if (icmp_quote_port(skb, icmp_csum, k.proto, inner_l4, port_off, pfrom, v->port, diff) < 0)
		goto err;
	count(COUNTER_ICMP_ERR_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

#undef FAMILY
#include "family.h"
