/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The fragments of frag.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: frag_key_v4, frag_key_v6, frag_remember_v4, frag_remember_v6,
 * frag_lookup_v4, frag_lookup_v6, egress_frag_v4, egress_frag_v6,
 * egress_frag_other_v4, egress_frag_other_v6, ingress_frag_v4,
 * ingress_frag_v6.
 */

#include "family.h"

static __always_inline void FAM(frag_key)(const struct pkt *p, int dir, FAM_T(frag, key) *k)
{
	__builtin_memset(k, 0, sizeof(*k));
	FAM_ADDR_COPY(k->src, FAM_PKT(p).saddr);
	FAM_ADDR_COPY(k->dst, FAM_PKT(p).daddr);
	k->id = p->frag_id;
	k->proto = p->proto;
	k->dir = dir;
}

/* frag_remember_v4/v6 record the address a first fragment was translated
 * to, for the datagram's later fragments. */
static __always_inline void FAM(frag_remember)(const struct pkt *p, int dir, const FAM_ADDR to)
{
	FAM_T(frag, key) k;
	FAM_T(frag, val) v;

	FAM(frag_key)(p, dir, &k);
	FAM_ADDR_COPY(v.addr, to);
	bpf_map_update_elem(&FAM(frag), &k, &v, BPF_ANY);
}

static __always_inline FAM_T(frag, val) *FAM(frag_lookup)(const struct pkt *p, int dir)
{
	FAM_T(frag, key) k;

	FAM(frag_key)(p, dir, &k);
	return bpf_map_lookup_elem(&FAM(frag), &k);
}

/* egress_frag_v4/v6 handle a non-first fragment from a masquerade source:
 * the L3 rewrite from the first fragment's record, none when the record
 * holds the source's own address (a flow kept unmasqueraded). */
static __always_inline int FAM(egress_frag)(struct __sk_buff *skb, const struct pkt *p,
					    const struct masq_rule *rule)
{
	FAM_T(frag, val) *f = FAM(frag_lookup)(p, DIR_EGRESS);
	FAM_ADDR from, to;
	enum counter c;

	if (!f) {
		c = FAM(decide)(skb, p, rule, &to);
		if (c != COUNTER_MASQUERADED) {
			count(c);
			return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
		}
		count(COUNTER_FRAG_UNKNOWN);
		return TC_ACT_SHOT;
	}
	FAM_ADDR_COPY(from, FAM_PKT(p).saddr);
	FAM_ADDR_COPY(to, f->addr);
	if (FAM_ADDR_EQ(from, to)) {
		/* the first fragment's flow started unmasqueraded (unmasq.h) */
		count(COUNTER_SKIP_NONMASQ_DST);
		return TC_ACT_UNSPEC;
	}
	if (FAM_REWRITE(skb, p, saddr, from, to, p->proto, 0, 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_FRAGMENTS);
	return TC_ACT_UNSPEC;
}

/* egress_frag_other_v4/v6 handle a non-first fragment from a source that
 * is not a masquerade source: the L3 rewrite when its first fragment was
 * translated (a former masquerade source's flow, translated while it
 * lasts: TC_ACT_OK, counted, or TC_ACT_SHOT), TC_ACT_UNSPEC (nothing done
 * or counted) otherwise: the node's own, and flows never masqueraded,
 * whose first fragments leave no record. */
static __noinline int FAM(egress_frag_other)(struct __sk_buff *skb, const struct pkt *p)
{
	FAM_T(frag, val) *f = FAM(frag_lookup)(p, DIR_EGRESS);
	FAM_ADDR from, to;

	FAM_ADDR_COPY(from, FAM_PKT(p).saddr);
	if (!f || FAM_ADDR_EQ(from, f->addr))
		return TC_ACT_UNSPEC;
	FAM_ADDR_COPY(to, f->addr);
	if (FAM_REWRITE(skb, p, saddr, from, to, p->proto, 0, 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_FRAGMENTS);
	return TC_ACT_OK;
}

/* ingress_frag_v4/v6 handle a non-first fragment on ingress: the L3
 * rewrite from the first fragment's record, untouched without one. */
static __always_inline int FAM(ingress_frag)(struct __sk_buff *skb, const struct pkt *p)
{
	FAM_T(frag, val) *f = FAM(frag_lookup)(p, DIR_INGRESS);
	FAM_ADDR from, to;

	if (!f)
		return TC_ACT_UNSPEC;
	FAM_ADDR_COPY(from, FAM_PKT(p).daddr);
	FAM_ADDR_COPY(to, f->addr);
	if (FAM_REWRITE(skb, p, daddr, from, to, p->proto, 0, 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_FRAGMENTS);
	return TC_ACT_UNSPEC;
}

#undef FAMILY
#include "family.h"
