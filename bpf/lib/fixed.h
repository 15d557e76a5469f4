/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * SCTP and every protocol without ports: pairs whose NAT port is fixed.
 *
 * SCTP keeps the pod's port: its CRC32c covers the SCTP packet but not the
 * IP header, so translating the address alone leaves it valid, and nothing
 * in the program has to recompute a CRC over the whole packet (no helper
 * does; a software CRC per packet would cost more than the rest of the
 * program). The price: two pods with the same source port to the same
 * remote address and port cannot share the SNAT address; the second
 * association's packets are dropped and counted (pair-taken). Linux would
 * move it to another port and recompute the CRC.
 *
 * GRE, ESP, AH, other IP protocols and the ICMP types that are neither
 * echo nor errors have no ports: they are translated address-only, one
 * pair per (pod, remote, protocol). The reply entry {remote, SNAT, 0, 0,
 * proto} can belong to one pod only, so a second pod talking the same
 * protocol to the same remote is dropped and counted (pair-taken) rather
 * than sent out with a translation whose answers would reach the first
 * pod. Of these, ICMPv6, DCCP and UDP-Lite have a checksum over a pseudo
 * header, which is kept right (DCCP and UDP-Lite ports are left alone).
 *
 * Entries carry the NAT "port" (the pod's SCTP port, or 0) so that the
 * collector and the dumps treat them like the other pairs.
 */

#ifndef IPMASQ_LIB_FIXED_H
#define IPMASQ_LIB_FIXED_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <asm-generic/errno-base.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "decision.h"
#include "flow.h"
#include "rewrite.h"
#include "frag.h"

/* nat_create_fixed_v4 inserts both entries of a pair whose NAT port is the
 * pod's own (out->sport: the SCTP port, or 0 for address-only). */
static __noinline enum counter nat_create_fixed_v4(const struct nat_v4_key *out, __be32 snat,
							struct nat_v4_val *res)
{
	struct nat_v4_key in = {
		.src = out->dst, .dst = snat, .sport = out->dport, .dport = out->sport,
		.proto = out->proto, .dir = DIR_INGRESS,
	};
	struct nat_v4_val rev = { .addr = out->src, .port = out->sport };
	struct nat_v4_val *cur;
	int created = 1;
	long ret;

	rev.last_seen_ns = rev.created_ns = bpf_ktime_get_ns();
	ret = bpf_map_update_elem(&nat_v4, &in, &rev, BPF_NOEXIST);
	if (ret == -EEXIST) {
		/* ours if another CPU is creating the same flow right now */
		cur = bpf_map_lookup_elem(&nat_v4, &in);
		if (!cur || cur->addr != out->src || cur->port != out->sport)
			return COUNTER_PAIR_TAKEN;
		created = 0;
	} else if (ret) {
		return COUNTER_NAT_FULL;
	}
	res->addr = snat;
	res->port = out->sport;
	res->flags = 0;
	res->last_seen_ns = rev.last_seen_ns;
	res->created_ns = rev.created_ns;
	ret = bpf_map_update_elem(&nat_v4, out, res, BPF_NOEXIST);
	if (ret == 0)
		return COUNTER_NAT_NEW;
	if (ret != -EEXIST) {
		if (created)
			bpf_map_delete_elem(&nat_v4, &in);
		return COUNTER_NAT_FULL;
	}
	cur = bpf_map_lookup_elem(&nat_v4, out);
	if (!cur)
		return COUNTER_ERROR;
	*res = *cur;
	return COUNTER_MASQUERADED;
}

static __noinline enum counter nat_create_fixed_v6(const struct nat_v6_key *out, const __u8 *snat,
						struct nat_v6_val *res)
{
	struct nat_v6_key in = {
		.sport = out->dport, .dport = out->sport, .proto = out->proto, .dir = DIR_INGRESS,
	};
	struct nat_v6_val *cur;
	int created = 1;
	__u64 now;
	long ret;

	/* snat may point into *res, which first holds the reply entry's value
	 * and then the pair's: one 48-byte value less on a stack the verifier
	 * limits for the whole call chain. */
	__builtin_memcpy(in.src, out->dst, 16);
	__builtin_memcpy(in.dst, snat, 16);
	now = bpf_ktime_get_ns();
	__builtin_memset(res, 0, sizeof(*res));
	__builtin_memcpy(res->addr, out->src, 16);
	res->port = out->sport;
	res->last_seen_ns = res->created_ns = now;
	ret = bpf_map_update_elem(&nat_v6, &in, res, BPF_NOEXIST);
	if (ret == -EEXIST) {
		cur = bpf_map_lookup_elem(&nat_v6, &in);
		if (!cur || !addr6_equal(cur->addr, out->src) || cur->port != out->sport)
			return COUNTER_PAIR_TAKEN;
		created = 0;
	} else if (ret) {
		return COUNTER_NAT_FULL;
	}
	__builtin_memcpy(res->addr, in.dst, 16);
	ret = bpf_map_update_elem(&nat_v6, out, res, BPF_NOEXIST);
	if (ret == 0)
		return COUNTER_NAT_NEW;
	if (ret != -EEXIST) {
		if (created)
			bpf_map_delete_elem(&nat_v6, &in);
		return COUNTER_NAT_FULL;
	}
	cur = bpf_map_lookup_elem(&nat_v6, out);
	if (!cur)
		return COUNTER_ERROR;
	*res = *cur;
	return COUNTER_MASQUERADED;
}

static __always_inline void count_fixed_new(const struct pkt *p, const struct masq_rule *rule)
{
	count(COUNTER_NAT_NEW);
	count(p->kind == PKT_SCTP ? COUNTER_NAT_NEW_SCTP : COUNTER_NAT_NEW_ADDR_ONLY);
	if (rule)
		count(COUNTER_NAT_NEW_BY_RULE);
}

/* The L4 checksum an address-only rewrite must fix: those that cover a
 * pseudo header (ICMPv6; DCCP and UDP-Lite, whose ports are left alone). */
static __always_inline __u32 fixed_csum_off(const struct pkt *p)
{
	switch (p->proto) {
	case IPPROTO_ICMPV6:
		return p->l4_off + 2;
	case IPPROTO_DCCP:
	case IPPROTO_UDPLITE:
		return p->l4_off + 6;
	}
	return 0;
}

static __noinline int egress_fixed_v4(struct __sk_buff *skb, const struct pkt *p,
					   const struct masq_rule *rule)
{
	struct nat_v4_key k = {
		.src = p->v4.saddr, .dst = p->v4.daddr, .sport = p->sport, .dport = p->dport,
		.proto = p->proto, .dir = DIR_EGRESS,
	};
	struct nat_v4_val *v, nv;
	enum counter c;
	__be32 snat;

	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (v) {
		nat_touch_v4(v, 0);
		nv.addr = v->addr;
	} else {
		c = decide_v4(skb, p->v4.saddr, p->v4.daddr, rule, &snat);
		if (c != COUNTER_MASQUERADED) {
			count(c);
			return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
		}
		c = nat_create_fixed_v4(&k, snat, &nv);
		if (c == COUNTER_NAT_NEW) {
			count_fixed_new(p, rule);
		} else if (c != COUNTER_MASQUERADED) {
			count(c);
			return TC_ACT_SHOT;
		}
	}
	if (p->frag == FRAG_FIRST)
		frag_remember_v4(p, DIR_EGRESS, nv.addr);
	if (rewrite_v4(skb, p->l3_off, p->l3_off + offsetof(struct iphdr, saddr), p->v4.saddr,
		       nv.addr, p->proto, fixed_csum_off(p), 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_MASQUERADED);
	return TC_ACT_UNSPEC;
}

static __noinline int egress_fixed_v6(struct __sk_buff *skb, const struct pkt *p,
					   const struct masq_rule *rule)
{
	struct nat_v6_key k = {
		.sport = p->sport, .dport = p->dport, .proto = p->proto, .dir = DIR_EGRESS,
	};
	struct nat_v6_val *v, nv;
	enum counter c;

	__builtin_memcpy(k.src, p->v6.saddr, 16);
	__builtin_memcpy(k.dst, p->v6.daddr, 16);
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (v) {
		nat_touch_v6(v, 0);
		__builtin_memcpy(nv.addr, v->addr, 16);
	} else {
		c = decide_v6(skb, p, rule, nv.addr);
		if (c != COUNTER_MASQUERADED) {
			count(c);
			return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
		}
		/* the SNAT address decide_v6 chose is in nv.addr */
		c = nat_create_fixed_v6(&k, nv.addr, &nv);
		if (c == COUNTER_NAT_NEW) {
			count_fixed_new(p, rule);
		} else if (c != COUNTER_MASQUERADED) {
			count(c);
			return TC_ACT_SHOT;
		}
	}
	if (p->frag == FRAG_FIRST)
		frag_remember_v6(p, DIR_EGRESS, nv.addr);
	if (rewrite_v6(skb, p->l3_off + offsetof(struct ipv6hdr, saddr), (__u8 *)p->v6.saddr, nv.addr, p->proto,
		       fixed_csum_off(p), 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_MASQUERADED);
	return TC_ACT_UNSPEC;
}

static __noinline int ingress_fixed_v4(struct __sk_buff *skb, const struct pkt *p)
{
	struct nat_v4_key k = {
		.src = p->v4.saddr, .dst = p->v4.daddr, .sport = p->sport, .dport = p->dport,
		.proto = p->proto, .dir = DIR_INGRESS,
	};
	struct nat_v4_val *v;
	__be32 to;

	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (!v)
		return TC_ACT_UNSPEC;
	nat_touch_v4(v, 0);
	to = v->addr;
	if (p->frag == FRAG_FIRST)
		frag_remember_v4(p, DIR_INGRESS, to);
	if (rewrite_v4(skb, p->l3_off, p->l3_off + offsetof(struct iphdr, daddr), p->v4.daddr, to,
		       p->proto, fixed_csum_off(p), 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_REVERSE);
	return TC_ACT_UNSPEC;
}

static __noinline int ingress_fixed_v6(struct __sk_buff *skb, const struct pkt *p)
{
	struct nat_v6_key k = {
		.sport = p->sport, .dport = p->dport, .proto = p->proto, .dir = DIR_INGRESS,
	};
	struct nat_v6_val *v;
	__u8 from[16], to[16];

	__builtin_memcpy(k.src, p->v6.saddr, 16);
	__builtin_memcpy(k.dst, p->v6.daddr, 16);
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (!v)
		return TC_ACT_UNSPEC;
	nat_touch_v6(v, 0);
	__builtin_memcpy(to, v->addr, 16);
	__builtin_memcpy(from, p->v6.daddr, 16);
	if (p->frag == FRAG_FIRST)
		frag_remember_v6(p, DIR_INGRESS, to);
	if (rewrite_v6(skb, p->l3_off + offsetof(struct ipv6hdr, daddr), from, to, p->proto,
		       fixed_csum_off(p), 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_REVERSE);
	return TC_ACT_UNSPEC;
}

/* egress_untranslatable_* handle a masquerade source's packet the program
 * cannot translate (an IPv6 header chain longer than it walks, a fragmented
 * ICMP error, an echo reply of no flow): dropped when its destination would be masqueraded, so the
 * pod address never leaves; passed otherwise. */
static __noinline int egress_untranslatable_v4(struct __sk_buff *skb, const struct pkt *p,
						 const struct masq_rule *rule)
{
	enum counter c;
	__be32 snat;

	c = decide_v4(skb, p->v4.saddr, p->v4.daddr, rule, &snat);
	if (c != COUNTER_MASQUERADED) {
		count(c);
		return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
	}
	count(COUNTER_DROP_UNTRANSLATABLE);
	return TC_ACT_SHOT;
}

static __noinline int egress_untranslatable_v6(struct __sk_buff *skb, const struct pkt *p,
						 const struct masq_rule *rule)
{
	struct nat_v6_val snat;
	enum counter c;

	c = decide_v6(skb, p, rule, snat.addr);
	if (c != COUNTER_MASQUERADED) {
		count(c);
		return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
	}
	count(COUNTER_DROP_UNTRANSLATABLE);
	return TC_ACT_SHOT;
}

#endif /* IPMASQ_LIB_FIXED_H */
