/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The egress path of egress.h for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers
 * it uses.
 *
 * Defines: egress_v4, egress_v6.
 */

#include "family.h"

static __always_inline int FAM(egress)(struct __sk_buff *skb, __u32 l3_off)
{
	FAM_T(nat, key) k = { .dir = DIR_EGRESS };
	FAM_T(nat, val) *v, nv;
	const struct masq_rule *rule;
	struct pkt p;
	enum counter c;
	int ret, verdict, node, how, former = 0;

	p.l3_off = l3_off;
	/* IPv6: 1 for a header chain the program does not handle */
	ret = FAM(parse_l3)(skb, &p);
	if (ret < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_UNSPEC;
	}
	/* Before the source check: the node's own errors count too. */
	if (ret == 0 && p.proto == (FAM_IS_V6 ? IPPROTO_ICMPV6 : IPPROTO_ICMP) && p.frag == FRAG_NONE) {
		verdict = FAM(egress_icmp_error)(skb, &p);
		if (verdict != NOT_TRANSLATED_ERROR)
			return verdict;
	}
	node = !FAM(masq_source)(skb, FAM_PKT(&p).saddr, &rule);
	if (node) {
		/* The node's own flow: translated only when a pod's flow held its
		 * tuple (host_flow_*). */
		if (ret == 0 && p.frag == FRAG_LATER) {
			/* A former masquerade source's flow translated its first
			 * fragment: the later ones follow its record. Called here,
			 * not from host_flow_*: a frame less in the deepest chain
			 * of calls, whose stack the verifier bounds. */
			verdict = FAM(egress_frag_other)(skb, &p);
			if (verdict == TC_ACT_SHOT)
				return TC_ACT_SHOT;
			if (verdict != TC_ACT_OK)
				count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		p.kind = PKT_OTHER; /* until host_flow parses L4 */
		verdict = ret != 0 ? HOST_PASS : FAM(host_flow)(skb, &p);
		/* conntrack's translation of a flow being handed back to it,
		 * to another port than the pair's (handover.h): looked for
		 * only during a hand-back, the rest of the checks the callee's,
		 * for this frame's room */
		if (verdict == HOST_PASS && ret == 0 && handback_on() && FAM(handback_stray)(skb, &p)) {
			count(COUNTER_DROP_HANDBACK);
			return TC_ACT_SHOT;
		}
		if (verdict != HOST_PAIR && verdict != HOST_FORMER) {
			count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		former = verdict == HOST_FORMER;
		rule = NULL;
	} else {
		if (ret > 0)
			return FAM(egress_untranslatable)(skb, &p, rule);
		if (p.frag == FRAG_LATER)
			return FAM(egress_frag)(skb, &p, rule);
		if (parse_l4(skb, &p, DIR_EGRESS) < 0) {
			/* truncated L4 header from a masquerade source: cannot translate */
			count(COUNTER_ERROR);
			return TC_ACT_SHOT;
		}
		if (p.kind == PKT_ECHO_INBOUND) {
			if (FAM(inbound_reply)(&p)) {
				count(COUNTER_SKIP_INBOUND_REPLY);
				return TC_ACT_UNSPEC;
			}
			/* an echo reply of no flow we know of */
			return FAM(egress_untranslatable)(skb, &p, rule);
		}
		if (p.kind == PKT_SCTP || p.kind == PKT_ADDR) {
			verdict = FAM(egress_fixed)(skb, &p, rule);
			/* A full table: drop a pair that is not assured, or refuse. */
			if (verdict == FIXED_FULL && FAM(nat_early_drop)())
				verdict = FAM(egress_fixed)(skb, &p, rule);
			if (verdict != FIXED_FULL)
				return verdict;
			count(COUNTER_NAT_FULL);
			return TC_ACT_SHOT;
		}
		if (p.kind == PKT_ICMP_ERR)
			return FAM(icmp_error_unmatched)(skb, &p, rule);
		if (p.kind != PKT_PORTS)
			return FAM(egress_untranslatable)(skb, &p, rule);
	}

	FAM_ADDR_COPY(k.src, FAM_PKT(&p).saddr);
	FAM_ADDR_COPY(k.dst, FAM_PKT(&p).daddr);
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	/* Established flows: the decision was taken when the pair was made
	 * (masq_source_* says what happens when a source stops being one). */
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (v) {
		/* A pod's SYN may open a new flow of the tuple (the pair
		 * closed or expired): decided again, so one the config no
		 * longer masquerades does not reopen the pair. */
		int renew = former || (!node && tcp_syn(&p) &&
				       FAM(decide)(skb, &p, rule, &nv.addr) != COUNTER_MASQUERADED);
		int est = FAM(nat_established)(skb, &k, v, &p, renew);

		if (est == NAT_EST_DROP) {
			count(COUNTER_DROP_PAIR_CLAIMED);
			return TC_ACT_SHOT;
		}
		if (est == NAT_EST_ARM)
			est = FAM(nat_cand_mark_run)(); /* 0 */
		/* The translation, unless read after a concurrent delete
		 * (another pair's, lib/flow.h) or the pair is being ended:
		 * then the packet has no pair. */
		if (est || !FAM(nat_use)(&k, v, &nv))
			v = NULL;
	}
	if (v) {
		if (former)
			count(COUNTER_FORMER_SOURCE);
	} else {
		if (former) {
			/* no longer a masquerade source: nothing new is made */
			count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		/* A flow that started unmasqueraded keeps that decision through
		 * config changes (unmasq.h). */
		if (!node && FAM(unmasq_kept)(&k, &p)) {
			/* Its later fragments pass too, whatever the config
			 * says of their destination now (egress_frag_*). */
			if (p.frag == FRAG_FIRST)
				FAM(frag_remember)(&p, DIR_EGRESS, FAM_PKT(&p).saddr);
			count(COUNTER_SKIP_NONMASQ_DST);
			return TC_ACT_UNSPEC;
		}
		how = egress_no_pair(&p, FAM_IS_V6, node);
		if (how == NO_PAIR_PASS)
			return TC_ACT_UNSPEC;
		if (node) {
			/* a new port, the same address */
			FAM_ADDR_COPY(nv.addr, FAM_PKT(&p).saddr);
		} else {
			c = FAM(decide)(skb, &p, rule, &nv.addr);
			if (c != COUNTER_MASQUERADED) {
				if (c == COUNTER_SKIP_NONMASQ_DST && how != NO_PAIR_ORPHAN)
					FAM(unmasq_record)(&k, &p);
				count(c);
				return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
			}
			if (how == NO_PAIR_ORPHAN) {
				count(COUNTER_DROP_NO_PAIR);
				return TC_ACT_SHOT;
			}
		}
		c = FAM(nat_new_pair)(skb, &k, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | (node ? NAT_CREATE_NODE : 0), &nv);
		/* A full table: drop a pair that is not assured, or refuse. A
		 * pair needs two entries: an inbound record dropped frees one,
		 * and another CPU's insert may take what a drop freed. Each
		 * retry takes the port its search found (NAT_CREATE_RETRY). */
		for (int i = 0; i < 3 && c == COUNTER_NAT_FULL && FAM(nat_early_drop)(); i++)
			c = FAM(nat_new_pair)(skb, &k, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | (node ? NAT_CREATE_NODE : 0) |
						       NAT_CREATE_RETRY, &nv);
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
		FAM(frag_remember)(&p, DIR_EGRESS, nv.addr);
	/* k.src is the packet's source (rewrite_v6 needs a copy off the packet). */
	if (FAM_REWRITE(skb, &p, saddr, k.src, nv.addr, p.proto, p.l4_off + l4_csum_off(p.proto),
			p.l4_off + l4_port_off(p.proto, DIR_EGRESS), p.sport, nv.port) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_MASQUERADED);
	return TC_ACT_UNSPEC;
}

#undef FAMILY
#include "family.h"
