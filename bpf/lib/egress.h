/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The egress path: every packet leaving through an egress device. */

#ifndef IPMASQ_LIB_EGRESS_H
#define IPMASQ_LIB_EGRESS_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "decision.h"
#include "flow.h"
#include "inbound.h"
#include "hostflow.h"
#include "ports.h"
#include "pressure.h"
#include "rewrite.h"
#include "frag.h"
#include "icmp.h"
#include "icmp_egress.h"
#include "fixed.h"

static __always_inline int egress_v4(struct __sk_buff *skb, __u32 l3_off)
{
	struct nat_v4_key k = { .dir = DIR_EGRESS };
	const struct masq_rule *rule;
	struct nat_v4_val *v, nv;
	struct pkt p;
	enum counter c;
	__be32 snat;
	int verdict, node, how, former = 0;

	p.l3_off = l3_off;
	if (parse_l3_v4(skb, &p) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_UNSPEC;
	}
	/* Before the source check: the node's own errors count too. */
	if (p.proto == IPPROTO_ICMP && p.frag == FRAG_NONE) {
		verdict = egress_icmp_error_v4(skb, &p);
		if (verdict != NOT_TRANSLATED_ERROR)
			return verdict;
	}
	node = !masq_source_v4(skb, p.v4.saddr, &rule);
	if (node) {
		/* The node's own flow: translated only when a pod's flow held its
		 * tuple (host_flow_v4). */
		verdict = host_flow_v4(skb, &p);
		if (verdict == HOST_PASS) {
			count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		former = verdict == HOST_FORMER;
		rule = NULL;
	} else {
		if (p.frag == FRAG_LATER)
			return egress_frag_v4(skb, &p, rule);
		if (parse_l4(skb, &p, DIR_EGRESS) < 0) {
			/* truncated L4 header from a masquerade source: cannot translate */
			count(COUNTER_ERROR);
			return TC_ACT_SHOT;
		}
		if (p.kind == PKT_ECHO_INBOUND) {
			if (inbound_reply_v4(&p)) {
				count(COUNTER_SKIP_INBOUND_REPLY);
				return TC_ACT_UNSPEC;
			}
			/* an echo reply of no flow we know of */
			return egress_untranslatable_v4(skb, &p, rule);
		}
		if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
			return egress_fixed_v4(skb, &p, rule);
		if (p.kind == PKT_ICMP_ERR)
			return icmp_error_unmatched_v4(skb, &p, rule);
		if (p.kind != PKT_PORTS)
			return egress_untranslatable_v4(skb, &p, rule);
	}

	k.src = p.v4.saddr;
	k.dst = p.v4.daddr;
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	/* Established flows: the decision was taken when the pair was made
	 * (masq_source_v4 says what happens when a source stops being one). */
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (v) {
		int est = nat_established_v4(skb, &k, v, &p, former);

		if (est == NAT_EST_DROP) {
			count(COUNTER_DROP_PAIR_CLAIMED);
			return TC_ACT_SHOT;
		}
		if (est)
			v = NULL;
	}
	if (v) {
		nv.addr = v->addr;
		nv.port = v->port;
		if (former)
			count(COUNTER_FORMER_SOURCE);
	} else {
		if (former) {
			/* no longer a masquerade source: nothing new is made */
			count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		how = egress_no_pair(&p, 0, node);
		if (how == NO_PAIR_PASS)
			return TC_ACT_UNSPEC;
		if (node) {
			snat = p.v4.saddr; /* a new port, the same address */
		} else {
			c = decide_v4(skb, &p, rule, &snat);
			if (c != COUNTER_MASQUERADED) {
				count(c);
				return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
			}
			if (how == NO_PAIR_ORPHAN) {
				count(COUNTER_DROP_NO_PAIR);
				return TC_ACT_SHOT;
			}
		}
		nv.addr = snat;
		c = nat_create_v4(skb, &k, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | (node ? NAT_CREATE_NODE : 0), &nv);
		/* A full table: drop a pair that is not assured, or refuse. */
		if (c == COUNTER_NAT_FULL && nat_early_drop_v4())
			c = nat_create_v4(skb, &k, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | (node ? NAT_CREATE_NODE : 0), &nv);
		if (c != COUNTER_NAT_NEW && c != COUNTER_MASQUERADED) {
			count(c);
			return TC_ACT_SHOT;
		}
		if (c == COUNTER_NAT_NEW) {
			count(node ? COUNTER_HOST_FLOW_REMAPPED : COUNTER_NAT_NEW);
			if (rule)
				count(COUNTER_NAT_NEW_BY_RULE);
			if (how == NO_PAIR_PICKUP)
				count(COUNTER_NAT_PICKED_UP);
		}
	}
	if (p.frag == FRAG_FIRST)
		frag_remember_v4(&p, DIR_EGRESS, nv.addr);
	if (rewrite_v4(skb, p.l3_off, p.l3_off + offsetof(struct iphdr, saddr), p.v4.saddr, nv.addr,
		       p.proto, p.l4_off + l4_csum_off(p.proto),
		       p.l4_off + l4_port_off(p.proto, DIR_EGRESS), p.sport, nv.port) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_MASQUERADED);
	return TC_ACT_UNSPEC;
}

static __always_inline int egress_v6(struct __sk_buff *skb, __u32 l3_off)
{
	struct nat_v6_key k = { .dir = DIR_EGRESS };
	struct nat_v6_val *v, nv;
	const struct masq_rule *rule;
	struct pkt p;
	enum counter c;
	int ret, verdict, node, how, former = 0;

	p.l3_off = l3_off;
	ret = parse_l3_v6(skb, &p);
	if (ret < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_UNSPEC;
	}
	if (ret == 0 && p.proto == IPPROTO_ICMPV6 && p.frag == FRAG_NONE) {
		verdict = egress_icmp_error_v6(skb, &p);
		if (verdict != NOT_TRANSLATED_ERROR)
			return verdict;
	}
	node = !masq_source_v6(skb, p.v6.saddr, &rule);
	if (node) {
		/* See egress_v4. */
		verdict = ret != 0 ? HOST_PASS : host_flow_v6(skb, &p);
		if (verdict == HOST_PASS) {
			count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		former = verdict == HOST_FORMER;
		rule = NULL;
	} else {
		if (ret > 0)
			return egress_untranslatable_v6(skb, &p, rule);
		if (p.frag == FRAG_LATER)
			return egress_frag_v6(skb, &p, rule);
		if (parse_l4(skb, &p, DIR_EGRESS) < 0) {
			count(COUNTER_ERROR);
			return TC_ACT_SHOT;
		}
		if (p.kind == PKT_ECHO_INBOUND) {
			if (inbound_reply_v6(&p)) {
				count(COUNTER_SKIP_INBOUND_REPLY);
				return TC_ACT_UNSPEC;
			}
			/* an echo reply of no flow we know of */
			return egress_untranslatable_v6(skb, &p, rule);
		}
		if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
			return egress_fixed_v6(skb, &p, rule);
		if (p.kind == PKT_ICMP_ERR)
			return icmp_error_unmatched_v6(skb, &p, rule);
		if (p.kind != PKT_PORTS)
			return egress_untranslatable_v6(skb, &p, rule);
	}

	__builtin_memcpy(k.src, p.v6.saddr, 16);
	__builtin_memcpy(k.dst, p.v6.daddr, 16);
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (v) {
		int est = nat_established_v6(skb, &k, v, &p, former);

		if (est == NAT_EST_DROP) {
			count(COUNTER_DROP_PAIR_CLAIMED);
			return TC_ACT_SHOT;
		}
		if (est)
			v = NULL;
	}
	if (v) {
		__builtin_memcpy(nv.addr, v->addr, 16);
		nv.port = v->port;
		if (former)
			count(COUNTER_FORMER_SOURCE);
	} else {
		if (former) {
			count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		how = egress_no_pair(&p, 1, node);
		if (how == NO_PAIR_PASS)
			return TC_ACT_UNSPEC;
		if (node) {
			__builtin_memcpy(nv.addr, p.v6.saddr, 16);
		} else {
			c = decide_v6(skb, &p, rule, &nv.addr);
			if (c != COUNTER_MASQUERADED) {
				count(c);
				return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
			}
			if (how == NO_PAIR_ORPHAN) {
				count(COUNTER_DROP_NO_PAIR);
				return TC_ACT_SHOT;
			}
		}
		c = nat_create_v6(skb, &k, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | (node ? NAT_CREATE_NODE : 0), &nv);
		if (c == COUNTER_NAT_FULL && nat_early_drop_v6())
			c = nat_create_v6(skb, &k, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | (node ? NAT_CREATE_NODE : 0), &nv);
		if (c != COUNTER_NAT_NEW && c != COUNTER_MASQUERADED) {
			count(c);
			return TC_ACT_SHOT;
		}
		if (c == COUNTER_NAT_NEW) {
			count(node ? COUNTER_HOST_FLOW_REMAPPED : COUNTER_NAT_NEW);
			if (rule)
				count(COUNTER_NAT_NEW_BY_RULE);
			if (how == NO_PAIR_PICKUP)
				count(COUNTER_NAT_PICKED_UP);
		}
	}
	if (p.frag == FRAG_FIRST)
		frag_remember_v6(&p, DIR_EGRESS, nv.addr);
	/* k.src is the packet's source (rewrite_v6 needs a copy off the packet). */
	if (rewrite_v6(skb, p.l3_off + offsetof(struct ipv6hdr, saddr), k.src, nv.addr,
		       p.proto, p.l4_off + l4_csum_off(p.proto),
		       p.l4_off + l4_port_off(p.proto, DIR_EGRESS), p.sport, nv.port) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_MASQUERADED);
	return TC_ACT_UNSPEC;
}

static __always_inline int egress(struct __sk_buff *skb, __u32 l3_off)
{
	switch (skb->protocol) {
	case bpf_htons(ETH_P_IP):
		return egress_v4(skb, l3_off);
	case bpf_htons(ETH_P_IPV6):
		return egress_v6(skb, l3_off);
	}
	return TC_ACT_UNSPEC;
}

#endif /* IPMASQ_LIB_EGRESS_H */
