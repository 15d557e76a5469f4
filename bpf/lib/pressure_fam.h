/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Early drop of pressure.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: struct early_drop_v4_ctx, struct early_drop_v6_ctx,
 * early_drop_slot_v4, early_drop_slot_v6, early_drop_victim_v4,
 * early_drop_victim_v6, nat_early_drop_v4, nat_early_drop_v6,
 * early_drop_scratch_v4, early_drop_scratch_v6.
 */

#include "family.h"

FAM_T(early_drop, ctx) {
	FAM_T(nat, key) victim;
	__u64 victim_seen;	/* the victim's last_seen_ns, as judged */
	__u64 victim_pos;	/* its slot in the ring */
	__u32 found;		/* candidates weighed */
	__u32 done;		/* the victim is a done pair (nat_done) */
	__u32 lead;		/* slots consumed from the window's start */
	__u32 pad;
};

/* The search's state lives in a per-CPU scratch value, not on the stack:
 * the ingress and egress call chains that reach early drop are near the
 * 512-byte limit. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, FAM_T(early_drop, ctx));
	__uint(max_entries, 1);
} FAM(early_drop_scratch) SEC(".maps");

#ifndef EARLY_DROP_DROPPED
#define EARLY_DROP_GONE		1
#define EARLY_DROP_DROPPED	2
#endif

/* early_drop_slot_v4/v6 judges the candidate in ring position pos, the
 * i-th of the search's window: an entry gone, or assured (or the slot
 * empty), consumes its slot; an entry that may go is weighed against the
 * victim so far (a done pair first, then the idlest). Everything judged is
 * read once (the stamp first: nat_claim then fails if anything changed)
 * and then checked to be still the key's: a deleted entry's element may
 * have been reused by another key meanwhile. A global function: the
 * verifier checks it once. Returns 0. */
GLOBAL_FUNC int FAM(early_drop_slot)(FAM_T(early_drop, ctx) *ctx, __u64 pos, __u32 i)
{
	__u32 slot = pos & (NAT_CAND_SLOTS - 1), done;
	FAM_T(nat, cand) *c;
	FAM_T(nat, val) *v, *again;
	__u64 created, seen;
	__u8 flags, proto, dir;

	if (!ctx)
		return 0;
	c = bpf_map_lookup_elem(&FAM(nat_cand), &slot);
	if (!c)
		return 0;
	/* The key is used in place (stack room): a note writing over the
	 * slot meanwhile changes created_ns, checked after the lookups. */
	created = *(volatile __u64 *)&c->created_ns;
	if (!created)
		goto consumed;
	proto = c->key.proto;
	dir = c->key.dir;
	v = bpf_map_lookup_elem(&FAM(nat), &c->key);
	if (!v) {
		if (*(volatile __u64 *)&c->created_ns != created)
			return 0; /* being written over by a newer note */
		goto clear;
	}
	seen = nat_stamp(&v->last_seen_ns);
	flags = *(volatile __u8 *)&v->flags;
	again = bpf_map_lookup_elem(&FAM(nat), &c->key);
	if (*(volatile __u64 *)&c->created_ns != created)
		return 0;
	if (again != v || seen == NAT_CLAIMED)
		return 0; /* reused, or another party's now: judged next time */
	if (dir == DIR_EGRESS || !nat_evictable(proto, flags))
		goto clear; /* assured: noted again if it starts closing */
	done = nat_done(proto, flags);
	if (!ctx->found || done > ctx->done ||
	    (done == ctx->done && (__s64)(seen - ctx->victim_seen) < 0)) {
		__builtin_memcpy(&ctx->victim, &c->key, sizeof(ctx->victim));
		ctx->victim_seen = seen;
		ctx->victim_pos = pos;
		ctx->done = done;
	}
	ctx->found++;
	return 0;
clear:
	atomic_cas64(&c->created_ns, created, 0);
consumed:
	if (ctx->lead == i)
		ctx->lead++;
	return 0;
}

/* early_drop_victim_v4/v6 drops the victim the search chose: claimed with
 * the stamp it was judged by (a pair answered, touched or reopened since
 * is kept), then judged again (its flags and its stamp are two writes: an
 * answer's flag may have landed between the judgment's reads), both halves
 * deleted, the egress entry first, and its slot consumed. Returns
 * EARLY_DROP_DROPPED, EARLY_DROP_GONE (room may have been made: the caller
 * tries again) or 0 (kept). */
static __noinline int FAM(early_drop_victim)(FAM_T(early_drop, ctx) *ctx)
{
	FAM_T(nat, key) peer;
	FAM_T(nat, val) *v, *o;
	FAM_T(nat, cand) *c;
	__u32 slot;

	v = bpf_map_lookup_elem(&FAM(nat), &ctx->victim);
	if (!v)
		return EARLY_DROP_GONE;
	if (!nat_claim(&v->last_seen_ns, ctx->victim_seen, NAT_CLAIMED))
		return 0;
	/* Claimed: no other party deletes or replaces the entry now. */
	if (!nat_evictable(ctx->victim.proto, *(volatile __u8 *)&v->flags))
		goto unclaim;
	if (ctx->victim.dir == DIR_INGRESS) {
		FAM(nat_pair)(&ctx->victim, v, &peer);
		o = bpf_map_lookup_elem(&FAM(nat), &peer);
		if (o && !(FAM_ADDR_EQ(o->addr, ctx->victim.dst) && o->port == ctx->victim.dport))
			o = NULL;
		if (!o && nat_being_made(bpf_ktime_get_ns(), v->created_ns))
			goto unclaim;
		if (o)
			FAM(nat_delete)(&peer);
	}
	FAM(nat_delete)(&ctx->victim);
	slot = ctx->victim_pos & (NAT_CAND_SLOTS - 1);
	c = bpf_map_lookup_elem(&FAM(nat_cand), &slot);
	if (c)
		atomic_store64(&c->created_ns, 0);
	return EARLY_DROP_DROPPED;
unclaim:
	atomic_cas64(&v->last_seen_ns, NAT_CLAIMED, ctx->victim_seen);
	return 0;
}

/* nat_early_drop_v4/v6 drops one pair that is not assured, both halves
 * (or one inbound record), from the candidates of evict.h, and says
 * whether the caller may try again. */
static __noinline int FAM(nat_early_drop)(void)
{
	FAM_T(early_drop, ctx) *ctx;
	struct nat_drop_state *s;
	__u32 fam = FAM_IS_V6, zero = 0, i, n;
	__u64 h, t, me;
	int r = 0;

	s = bpf_map_lookup_elem(&nat_drop, &fam);
	ctx = bpf_map_lookup_elem(&FAM(early_drop_scratch), &zero);
	if (!s || !ctx)
		return 0;
	__builtin_memset(ctx, 0, sizeof(*ctx));
	/* Every note consumed: refused at a lookup's cost. */
	if (*(volatile __u64 *)&s->head == *(volatile __u64 *)&s->tail)
		return 0;
	me = nat_walker_lock(s, fam);
	if (!me)
		return 0;
	h = *(volatile __u64 *)&s->head;
	t = *(volatile __u64 *)&s->tail;
	if (h - t > NAT_CAND_SLOTS)
		t = h - NAT_CAND_SLOTS; /* older notes were written over */
	n = h - t > NAT_EARLY_DROP_SLOTS ? NAT_EARLY_DROP_SLOTS : h - t;
	for (i = 0; i < NAT_EARLY_DROP_SLOTS; i++) {
		if (i >= n || ctx->found >= NAT_EARLY_DROP_CANDIDATES)
			break;
		FAM(early_drop_slot)(ctx, t + i, i);
	}
	if (ctx->found) {
		r = FAM(early_drop_victim)(ctx);
		if (r && ctx->victim_pos == t + ctx->lead)
			ctx->lead++;
	}
	*(volatile __u64 *)&s->tail = t + ctx->lead;
	nat_walker_unlock(s, me);
	if (r == EARLY_DROP_DROPPED)
		count(COUNTER_NAT_EARLY_DROP);
	return r != 0;
}

#undef FAMILY
#include "family.h"
