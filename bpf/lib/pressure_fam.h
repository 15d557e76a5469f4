/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Early drop of pressure.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 */

#include "family.h"

FAM_T(early_drop, ctx) {
	FAM_T(nat, key) victim;
	__u64 victim_seen;	/* the victim's last_seen_ns */
	__u32 found;		/* candidates looked at */
	__u32 done;		/* the victim is a done pair (nat_done) */
};

/* early_drop_consider_v4/v6 results, bits: */
#ifndef EARLY_DROP_TAKE
#define EARLY_DROP_TAKE		1	/* the candidate is the victim so far: copy its key */
#define EARLY_DROP_ENOUGH	2	/* enough candidates looked at: stop the walk */
#endif

/* early_drop_consider_v4/v6 weighs a candidate (a reply entry whose pair
 * may go, of protocol proto, with flags, last seen at seen) against the
 * victim so far, and counts it. A global function: the verifier checks it
 * once, and does not follow the count and the victim's fields through
 * every step of the walk (which it cannot bound). */
__noinline int FAM(early_drop_consider)(FAM_T(early_drop, ctx) *ctx, __u8 proto, __u8 flags, __u64 seen)
{
	__u32 done;
	int r = 0;

	if (!ctx)
		return EARLY_DROP_ENOUGH;
	done = nat_done(proto, flags);
	if (!ctx->found || done > ctx->done ||
	    (done == ctx->done && (__s64)(seen - ctx->victim_seen) < 0)) {
		ctx->victim_seen = seen;
		ctx->done = done;
		r = EARLY_DROP_TAKE;
	}
	ctx->found++;
	if (ctx->found >= NAT_EARLY_DROP_CANDIDATES)
		r |= EARLY_DROP_ENOUGH;
	return r;
}

/* The search's callback: the first NAT_EARLY_DROP_CANDIDATES reply entries
 * whose pair may go are weighed (see NAT_EARLY_DROP_CANDIDATES). A claimed
 * entry is another party's. */
static long FAM(early_drop_cb)(void *map, const FAM_T(nat, key) *k, FAM_T(nat, val) *v,
			       FAM_T(early_drop, ctx) *ctx)
{
	__u64 seen;
	int r;

	if (k->dir != DIR_INGRESS || !nat_evictable(k->proto, v->flags))
		return 0;
	seen = nat_stamp(&v->last_seen_ns);
	if (seen == NAT_CLAIMED)
		return 0;
	r = FAM(early_drop_consider)(ctx, k->proto, v->flags, seen);
	if (r & EARLY_DROP_TAKE)
		__builtin_memcpy(&ctx->victim, k, sizeof(*k));
	return (r & EARLY_DROP_ENOUGH) ? 1 : 0;
}

/* nat_early_drop_v4/v6 drops one pair that is not assured, both halves,
 * and says whether it did. */
static __noinline int FAM(nat_early_drop)(void)
{
	FAM_T(early_drop, ctx) ctx = {};
	FAM_T(nat, key) peer;
	FAM_T(nat, val) *v, *o;
	__u64 now = bpf_ktime_get_ns(), *until;

	until = nat_search_allowed(FAM_IS_V6, now);
	if (!until)
		return 0;
	bpf_for_each_map_elem(&FAM(nat), FAM(early_drop_cb), &ctx, 0);
	if (!ctx.found) {
		*until = now + NAT_FULL_BACKOFF_NS;
		return 0;
	}
	v = bpf_map_lookup_elem(&FAM(nat), &ctx.victim);
	if (!v)
		return 1; /* gone meanwhile: room may have been made, the caller tries again */
	FAM(nat_pair)(&ctx.victim, v, &peer);
	o = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (o && !(FAM_ADDR_EQ(o->addr, ctx.victim.dst) && o->port == ctx.victim.dport))
		o = NULL;
	if (!o && nat_being_made(now, v->created_ns))
		return 0;
	/* Claimed by another party meanwhile (lib/flow.h): room may have
	 * been made, the caller tries again. */
	if (!nat_claim(&v->last_seen_ns, nat_stamp(&v->last_seen_ns), NAT_CLAIMED))
		return 1;
	if (o)
		FAM(nat_delete)(&peer);
	FAM(nat_delete)(&ctx.victim);
	count(COUNTER_NAT_EARLY_DROP);
	return 1;
}

#undef FAMILY
#include "family.h"
