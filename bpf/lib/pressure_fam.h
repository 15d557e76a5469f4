/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Early drop of pressure.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: struct early_drop_v4_cand, struct early_drop_v6_cand,
 * struct early_drop_v4_ctx, struct early_drop_v6_ctx, early_drop_slot_v4,
 * early_drop_slot_v6, early_drop_victim_v4, early_drop_victim_v6,
 * nat_early_drop_v4, nat_early_drop_v6, early_drop_scratch_v4,
 * early_drop_scratch_v6.
 */

#include "family.h"

/* A candidate the search weighed. */
FAM_T(early_drop, cand) {
	FAM_T(nat, key) key;
	__u64 seen;		/* its last_seen_ns, as judged */
	__u64 created;		/* its note's created_ns */
	__u32 slot;		/* its note's slot */
	__u32 rank;		/* EARLY_DROP_EXPIRED, _DONE or _IN_FLIGHT */
};

FAM_T(early_drop, ctx) {
	FAM_T(early_drop, cand) best[2];	/* the best, then the next */
	__u64 now;
	__u32 found;		/* candidates weighed */
	__u32 lookups;		/* NAT lookups left to this search: 0 ends it */
	__u32 want;		/* candidates that end it */
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

/* early_drop_slot_v4/v6 judges the note in slot, if it is worth a lookup
 * (early_drop_worth) and the search has one left: an entry gone clears
 * it, one assured and alive arms it with its stamp (evict.h), one that may
 * go is weighed against the best two so far (expired first, then done,
 * then the idlest). Everything judged is read
 * once, the stamp first: nat_claim then fails if anything changed. One
 * lookup: an element deleted and reused by another key meanwhile may be
 * judged by that key's flags (at worst a note cleared or armed, or a
 * candidate weighed wrongly), but never dropped: early_drop_victim looks
 * the key up again and claims from the stamp judged, which the key's own
 * entry does not have. The search's state is this CPU's
 * early_drop_scratch. A global function that takes no pointer (every
 * kernel from 5.10 takes it): the verifier checks it once, not at each of
 * the search's reads. Returns 0. */
__noinline int FAM(early_drop_slot)(__u32 slot)
{
	struct masq_config *cfg = masq_cfg();
	FAM_T(early_drop, ctx) *ctx;
	FAM_T(early_drop, cand) *b;
	FAM_T(nat, cand) *c;
	FAM_T(nat, val) *v;
	__u64 created, seen;
	__u8 flags, proto, dir;
	__u32 rank, zero = 0;

	ctx = bpf_map_lookup_elem(&FAM(early_drop_scratch), &zero);
	if (!ctx || !cfg)
		return 0;
	c = bpf_map_lookup_elem(&FAM(nat_cand), &slot);
	if (!c)
		return 0;
	/* The key is used in place (stack room): a note writing over the
	 * slot meanwhile changes created_ns, checked after the lookups. */
	created = *(volatile __u64 *)&c->created_ns;
	if (!ctx->lookups || !early_drop_worth(cfg, created, c->key.proto, ctx->now))
		return 0;
	ctx->lookups--;
	proto = c->key.proto;
	dir = c->key.dir;
	v = bpf_map_lookup_elem(&FAM(nat), &c->key);
	if (!v) {
		if (*(volatile __u64 *)&c->created_ns == created)
			c->created_ns = 0; /* gone */
		return 0;
	}
	seen = nat_stamp(&v->last_seen_ns);
	flags = *(volatile __u8 *)&v->flags;
	if (*(volatile __u64 *)&c->created_ns != created)
		return 0; /* being written over by a newer note */
	if (seen == NAT_CLAIMED)
		return 0; /* another party's now: judged next time */
	if ((dir != DIR_INGRESS && dir != DIR_INBOUND) || (flags & NAT_F_HOST))
		goto clear;
	if (nat_expired(cfg, proto, flags, seen, ctx->now))
		rank = EARLY_DROP_EXPIRED;
	else if (nat_evictable(proto, flags))
		rank = nat_done(proto, flags) ? EARLY_DROP_DONE : EARLY_DROP_IN_FLIGHT;
	else
		goto arm; /* assured: not looked up again before it may expire */
	/* Enough weighed: the search ends with this one, whether or not it
	 * is among the best two. */
	if (++ctx->found >= ctx->want)
		ctx->lookups = 0;
	b = &ctx->best[0];
	if (ctx->found > 1 && (rank < b->rank || (rank == b->rank && (__s64)(seen - b->seen) >= 0))) {
		/* not the best: the next? */
		b = &ctx->best[1];
		if (ctx->found > 2 && (rank < b->rank || (rank == b->rank && (__s64)(seen - b->seen) >= 0)))
			return 0;
	} else if (ctx->found > 1) {
		__builtin_memcpy(&ctx->best[1], b, sizeof(*b));
	}
	__builtin_memcpy(&b->key, &c->key, sizeof(b->key));
	b->seen = seen;
	b->created = created;
	b->slot = slot;
	b->rank = rank;
	/* The best two done or expired: the next could only be as good (a
	 * second, for a claim lost to another CPU). */
	if (ctx->found > 1 && ctx->best[1].rank >= EARLY_DROP_DONE)
		ctx->lookups = 0;
	return 0;
arm:
	if (*(volatile __u64 *)&c->created_ns == created)
		c->created_ns = seen | NAT_NOTE_ARMED;
	return 0;
clear:
	if (*(volatile __u64 *)&c->created_ns == created)
		c->created_ns = 0;
	return 0;
}

/* early_drop_victim_v4/v6 drops the search's i-th best candidate: claimed
 * with the stamp it was judged by (a pair answered, touched or reopened
 * since is kept), then judged again (its flags and its stamp are two
 * writes: an answer's flag may have landed between the judgment's reads;
 * an expiry by both halves' stamps), both halves deleted, the egress entry
 * first, and its note cleared. Returns EARLY_DROP_DROPPED, EARLY_DROP_GONE
 * (room may have been made: the caller tries again) or 0 (kept). */
static __noinline int FAM(early_drop_victim)(FAM_T(early_drop, ctx) *ctx, __u32 i)
{
	struct masq_config *cfg = masq_cfg();
	FAM_T(early_drop, cand) *b;
	FAM_T(nat, key) peer;
	FAM_T(nat, val) *v, *o;
	FAM_T(nat, cand) *c;
	__u64 last;
	__u32 *f;
	__u8 flags;

	if (i > 1 || !cfg)
		return 0;
	b = &ctx->best[i];
	v = bpf_map_lookup_elem(&FAM(nat), &b->key);
	if (!v)
		return EARLY_DROP_GONE;
	if (!nat_claim(&v->last_seen_ns, b->seen, NAT_CLAIMED))
		return 0;
	/* Claimed: no other party deletes or replaces the entry now. */
	flags = *(volatile __u8 *)&v->flags;
	o = NULL;
	if (b->key.dir == DIR_INGRESS) {
		FAM(nat_pair)(&b->key, v, &peer);
		o = bpf_map_lookup_elem(&FAM(nat), &peer);
		if (o && !(FAM_ADDR_EQ(o->addr, b->key.dst) && o->port == b->key.dport))
			o = NULL;
		if (!o && nat_being_made(ctx->now, v->created_ns))
			goto unclaim;
	}
	last = o ? nat_later(nat_stamp(&o->last_seen_ns), b->seen) : b->seen;
	if (!nat_evictable(b->key.proto, flags) &&
	    (flags & NAT_F_HOST || !nat_expired(cfg, b->key.proto, flags | (o ? o->flags : 0), last, ctx->now))) {
		/* assured, and its other half is alive: its note armed with
		 * the later stamp, not looked up before that may expire */
		c = bpf_map_lookup_elem(&FAM(nat_cand), &b->slot);
		if (c && *(volatile __u64 *)&c->created_ns == b->created)
			c->created_ns = flags & NAT_F_HOST ? 0 : last | NAT_NOTE_ARMED;
		goto unclaim;
	}
	/* Both halves deleted without looking them up again: the reply
	 * entry is claimed (its flags read above), the egress entry's class
	 * needs none. */
	if (o)
		FAM(nat_delete_claimed)(&peer, 0);
	FAM(nat_delete_claimed)(&b->key, flags);
	c = bpf_map_lookup_elem(&FAM(nat_cand), &b->slot);
	if (c && *(volatile __u64 *)&c->created_ns == b->created) {
		c->created_ns = 0;
		/* for the new flow's note (evict.h) */
		i = FAM_IS_V6;
		f = bpf_map_lookup_elem(&nat_note_free, &i);
		if (f)
			*f = b->slot + 1;
	}
	return EARLY_DROP_DROPPED;
unclaim:
	atomic_cas64(&v->last_seen_ns, NAT_CLAIMED, b->seen);
	return 0;
}

/* nat_early_drop_v4/v6 drops one pair that may go, both halves (or one
 * inbound record), found among the notes of evict.h, and says whether the
 * caller may try again. A global function (it takes nothing): the verifier
 * checks it once, not at each of its callers' tries. */
__noinline int FAM(nat_early_drop)(void)
{
	FAM_T(early_drop, ctx) *ctx;
	__u32 zero = 0, w, i, start, small;
	int r = 0;

	ctx = bpf_map_lookup_elem(&FAM(early_drop_scratch), &zero);
	if (!ctx)
		return 0;
	ctx->found = 0;
	ctx->now = bpf_ktime_get_ns();
	/* A table of up to NAT_EARLY_DROP_SLOTS slots is read whole, each
	 * note worth it looked up: with so few pairs, any that may go is
	 * found. */
	small = FAM(nat_note_slots) <= NAT_EARLY_DROP_SLOTS;
	ctx->lookups = small ? NAT_EARLY_DROP_SLOTS : NAT_EARLY_DROP_LOOKUPS;
	ctx->want = small ? NAT_EARLY_DROP_SLOTS : NAT_EARLY_DROP_CANDIDATES;
	/* Each window from a random start of its own (windows at fixed
	 * distances would read the same few slots' classes, and empty them of
	 * pairs that may go). */
	for (w = 0; w < NAT_EARLY_DROP_WINDOWS; w++) {
		/* A search that has ended (enough weighed, or its lookups
		 * spent) ends whole: no window more, no random start drawn. */
		if (!ctx->lookups)
			goto weighed;
		start = small ? w * NAT_EARLY_DROP_WINDOW : bpf_get_prandom_u32();
		for (i = 0; i < NAT_EARLY_DROP_WINDOW; i++) {
			if (!ctx->lookups)
				goto weighed;
			if (small && start + i >= FAM(nat_note_slots))
				break;
			FAM(early_drop_slot)((start + i) % FAM(nat_note_slots));
		}
	}
weighed:
	if (ctx->found)
		r = FAM(early_drop_victim)(ctx, 0);
	/* Lost its claim (answered, reopened, or another CPU's victim too):
	 * the next candidate. */
	if (!r && ctx->found > 1)
		r = FAM(early_drop_victim)(ctx, 1);
	if (r == EARLY_DROP_DROPPED)
		count(COUNTER_NAT_EARLY_DROP);
	return r != 0;
}

#undef FAMILY
#include "family.h"
