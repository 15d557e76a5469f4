/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The fixed pairs of fixed.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: nat_create_fixed_v4, nat_create_fixed_v6, fixed_unassure_v4,
 * fixed_unassure_v6, fixed_assure_note_v4, fixed_assure_note_v6,
 * egress_fixed_v4, egress_fixed_v6, ingress_fixed_v4,
 * ingress_fixed_v6, egress_untranslatable_v4, egress_untranslatable_v6,
 * fixed_scratch_v4, fixed_scratch_v6.
 */

#include "family.h"

/* nat_create_fixed_v4/v6 insert both entries of a pair whose NAT port is
 * the pod's own (out->sport: the SCTP port, or 0 for address-only). *res
 * holds the reply entry's value first and then the pair's: one value less
 * on a stack the verifier limits for the whole call chain. snat may point
 * into *res (IPv6), so it is read before *res is written; on failure
 * res->addr holds it again. */
static __noinline enum counter FAM(nat_create_fixed)(const FAM_T(nat, key) *out, const FAM_ADDR snat,
						     FAM_T(nat, val) *res)
{
	FAM_T(nat, key) in = {
		.sport = out->dport, .dport = out->sport, .proto = out->proto, .dir = DIR_INGRESS,
	};
	FAM_T(nat, val) *cur;
	int created = 1;
	long ret;

	FAM_ADDR_COPY(in.src, out->dst);
	FAM_ADDR_COPY(in.dst, snat);
	__builtin_memset(res, 0, sizeof(*res));
	FAM_ADDR_COPY(res->addr, out->src);
	res->port = out->sport;
	/* The time lives in *res only: a local kept across the inserts
	 * took 16 bytes of the egress chain's stack. */
	res->last_seen_ns = res->created_ns = bpf_ktime_get_ns();
	ret = FAM(nat_insert)(&in, res);
	/* res->addr is the SNAT address again from here, whatever the
	 * outcome (the caller may make room and retry) */
	FAM_ADDR_COPY(res->addr, in.dst);
	if (ret == -EEXIST) {
		/* ours if another CPU is creating the same flow right now */
		cur = bpf_map_lookup_elem(&FAM(nat), &in);
		if (!cur || !FAM_ADDR_EQ(cur->addr, out->src) || cur->port != out->sport)
			return COUNTER_PAIR_TAKEN;
		created = 0;
	} else if (ret) {
		return COUNTER_NAT_FULL;
	} else {
		/* Not assured: early drop may take it (evict.h). Noted now (stack
		 * room): if the egress entry fails, the note is met stale. */
		FAM(nat_cand_note)(&in, res->created_ns);
	}
	ret = FAM(nat_insert)(out, res);
	if (ret == 0)
		return COUNTER_NAT_NEW;
	if (ret != -EEXIST) {
		if (created)
			FAM(nat_delete)(&in);
		return COUNTER_NAT_FULL;
	}
	cur = bpf_map_lookup_elem(&FAM(nat), out);
	if (!cur)
		return COUNTER_ERROR;
	*res = *cur;
	return COUNTER_MASQUERADED;
}

/* fixed_unassure_v4/v6 makes the pair of egress entry k (value v)
 * evictable again: its association is ending; noted again for early drop
 * (its note was armed when it was assured: evict.h). */
static __noinline void FAM(fixed_unassure)(const FAM_T(nat, key) *k, const FAM_T(nat, val) *v)
{
	FAM_T(nat, key) peer;
	FAM_T(nat, val) *r;

	FAM(nat_pair)(k, v, &peer);
	r = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (r && (r->flags & NAT_F_SEEN)) {
		fixed_assure(&r->flags, FIXED_UNASSURE);
		FAM(nat_cand_note)(&peer, r->created_ns);
	}
}

/* fixed_assure_note_v4/v6 applies the assurance change how (one that
 * changes v's flags) to the reply entry v (key k, stamp as the packet's
 * touch left it) and its note: one whose association ends is noted again,
 * an assured pair's note is armed (evict.h) by the caller, when this
 * returns 1 (nat_cand_mark_run: a frame more here would take the IPv6
 * ingress chain's stack over 512 bytes before 6.6). Its own frame: the
 * ingress chain's stack. */
static __noinline int FAM(fixed_assure_note)(const FAM_T(nat, key) *k, FAM_T(nat, val) *v, int how, __u64 stamp)
{
	fixed_assure(&v->flags, how);
	if (how == FIXED_UNASSURE) {
		FAM(nat_cand_note)(k, v->created_ns);
		return 0;
	}
	return stamp != NAT_CLAIMED && FAM(nat_cand_mark_set)(k, v->created_ns, stamp | NAT_NOTE_ARMED);
}

/* The pair's key and value while egress_fixed makes it, per CPU (a tc
 * program runs to its end on its CPU): on the stack they took the IPv6
 * egress chain over the verifier's 512 bytes on kernels that round each
 * frame up to 32 bytes (before 6.6). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, FAM_T(nat, scratch));
	__uint(max_entries, 1);
} FAM(fixed_scratch) SEC(".maps");

/* egress_fixed_v4/v6 translate a fixed pair's packet from a masquerade
 * source: a tc verdict, or FIXED_FULL (nothing counted) when its new pair
 * found the table full: the caller drops a pair that is not assured and
 * calls again, or refuses the packet (the early drop's frame under this
 * one's would take the stack over the verifier's 512 bytes). */
static __noinline int FAM(egress_fixed)(struct __sk_buff *skb, const struct pkt *p,
					const struct masq_rule *rule)
{
	FAM_T(nat, scratch) *s;
	FAM_T(nat, key) *k;
	FAM_T(nat, val) *v, *nv;
	enum counter c;
	__u32 zero = 0;

	s = bpf_map_lookup_elem(&FAM(fixed_scratch), &zero);
	if (!s)
		return TC_ACT_SHOT;
	k = &s->key;
	nv = &s->val;
	__builtin_memset(k, 0, sizeof(*k));
	k->sport = p->sport;
	k->dport = p->dport;
	k->proto = p->proto;
	k->dir = DIR_EGRESS;
	FAM_ADDR_COPY(k->src, FAM_PKT(p).saddr);
	FAM_ADDR_COPY(k->dst, FAM_PKT(p).daddr);
	v = bpf_map_lookup_elem(&FAM(nat), k);
	if (v) {
		/* the stamp, in nv->last_seen_ns */
		nv->last_seen_ns = FAM(nat_touch)(v, 0);
		FAM_ADDR_COPY(nv->addr, v->addr);
		/* A pair being ended, or an entry reused by another pair
		 * meanwhile: never sent with the address it names. */
		if (!FAM(nat_still)(k, v, nv->last_seen_ns)) {
			count(COUNTER_DROP_PAIR_CLAIMED);
			return TC_ACT_SHOT;
		}
		/* The pod's SHUTDOWN or ABORT: the association may go for a
		 * new flow (rare packets: one more lookup). */
		if (fixed_assurance(skb, p, DIR_EGRESS) == FIXED_UNASSURE)
			FAM(fixed_unassure)(k, v);
	} else {
		c = FAM(decide)(skb, p, rule, &nv->addr);
		if (c != COUNTER_MASQUERADED) {
			count(c);
			return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
		}
		/* the SNAT address decide chose is in nv->addr */
		c = FAM(nat_create_fixed)(k, nv->addr, nv);
		if (c == COUNTER_NAT_FULL)
			return FIXED_FULL; /* the caller makes room, or refuses */
		if (c == COUNTER_NAT_NEW) {
			count_fixed_new(p, rule);
		} else if (c != COUNTER_MASQUERADED) {
			count(c);
			return TC_ACT_SHOT;
		}
	}
	if (p->frag == FRAG_FIRST)
		FAM(frag_remember)(p, DIR_EGRESS, nv->addr);
	if (FAM_REWRITE(skb, p, saddr, FAM_PKT(p).saddr, nv->addr, p->proto, fixed_csum_off(p),
			0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_MASQUERADED);
	return TC_ACT_UNSPEC;
}

static __noinline int FAM(ingress_fixed)(struct __sk_buff *skb, const struct pkt *p)
{
	FAM_T(nat, key) k = {
		.sport = p->sport, .dport = p->dport, .proto = p->proto, .dir = DIR_INGRESS,
	};
	FAM_T(nat, val) *v;
	FAM_ADDR from, to;
	__u64 stamp;
	int how;

	FAM_ADDR_COPY(k.src, FAM_PKT(p).saddr);
	FAM_ADDR_COPY(k.dst, FAM_PKT(p).daddr);
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (!v)
		return TC_ACT_UNSPEC;
	stamp = FAM(nat_touch)(v, 0);
	FAM_ADDR_COPY(to, v->addr);
	/* A pair being ended, or an entry reused by another pair
	 * meanwhile: never sent to the pod it names. */
	if (!FAM(nat_still)(&k, v, stamp)) {
		count(COUNTER_DROP_PAIR_CLAIMED);
		return TC_ACT_SHOT;
	}
	how = fixed_assurance(skb, p, DIR_INGRESS);
	if (((how == FIXED_ASSURE && !(v->flags & NAT_F_SEEN)) || (how == FIXED_UNASSURE && (v->flags & NAT_F_SEEN))) &&
	    FAM(fixed_assure_note)(&k, v, how, stamp))
		FAM(nat_cand_mark_run)();
	FAM_ADDR_COPY(from, FAM_PKT(p).daddr);
	if (p->frag == FRAG_FIRST)
		FAM(frag_remember)(p, DIR_INGRESS, to);
	if (FAM_REWRITE(skb, p, daddr, from, to, p->proto, fixed_csum_off(p), 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_REVERSE);
	return TC_ACT_UNSPEC;
}

/* egress_untranslatable_v4/v6 handle a masquerade source's packet the
 * program cannot translate (an IPv6 header chain longer than it walks, a
 * fragmented ICMP error, an echo reply of no flow): dropped when its
 * destination would be masqueraded, so the pod address never leaves;
 * passed otherwise. */
static __noinline int FAM(egress_untranslatable)(struct __sk_buff *skb, const struct pkt *p,
						 const struct masq_rule *rule)
{
	FAM_ADDR snat;
	enum counter c;

	c = FAM(decide)(skb, p, rule, &snat);
	if (c != COUNTER_MASQUERADED) {
		count(c);
		return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
	}
	count(COUNTER_DROP_UNTRANSLATABLE);
	return TC_ACT_SHOT;
}

#undef FAMILY
#include "family.h"
