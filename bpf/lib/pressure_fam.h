/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Early drop of pressure.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 */

#include "family.h"

FAM_T(early_drop, ctx) {
	FAM_T(nat, key) victim;
	__u32 found;
};

/* The search's callback: the first reply entry whose pair may go. */
static long FAM(early_drop_cb)(void *map, const FAM_T(nat, key) *k, FAM_T(nat, val) *v,
			       FAM_T(early_drop, ctx) *ctx)
{
	if (k->dir != DIR_INGRESS || !nat_evictable(k->proto, v->flags))
		return 0;
	__builtin_memcpy(&ctx->victim, k, sizeof(*k));
	ctx->found = 1;
	return 1;
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
	/* Gone or claimed by another party meanwhile (lib/flow.h): room may
	 * have been made, the caller tries again. */
	if (!v || !nat_claim(&v->last_seen_ns, nat_stamp(&v->last_seen_ns), NAT_CLAIMED))
		return 1;
	FAM(nat_pair)(&ctx.victim, v, &peer);
	o = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (o && FAM_ADDR_EQ(o->addr, ctx.victim.dst) && o->port == ctx.victim.dport)
		bpf_map_delete_elem(&FAM(nat), &peer);
	bpf_map_delete_elem(&FAM(nat), &ctx.victim);
	count(COUNTER_NAT_EARLY_DROP);
	return 1;
}

#undef FAMILY
#include "family.h"
