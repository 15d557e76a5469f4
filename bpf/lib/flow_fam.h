/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The pair state of flow.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: nat_touch_v4, nat_touch_v6, nat_still_v4, nat_still_v6,
 * nat_pair_v4, nat_pair_v6, nat_established_v4, nat_established_v6,
 * nat_reply_fin_v4, nat_reply_fin_v6, nat_reply_rst_v4, nat_reply_rst_v6,
 * nat_reply_syn_v4, nat_reply_syn_v6,
 * nat_takeover_v4, nat_takeover_v6, nat_use_v4, nat_use_v6.
 */

#include "family.h"

/* nat_touch_v4/v6 notes a packet on entry v: its new flags, and the time.
 * The flags go first and the stamp after, by a compare-and-swap from the
 * stamp read before them: a party that judged the entry by an older stamp
 * then fails its claim (lib/flow.h), and a claim taken meanwhile is never
 * written over (a plain store after the check could undo it, and let a
 * second party claim the entry). Returns the stamp as the touch left it:
 * NAT_CLAIMED when the entry is another party's (claimed before, or while,
 * the touch ran; a party that claims after it fails). */
static __always_inline __u64 FAM(nat_touch)(FAM_T(nat, val) *v, __u8 flags)
{
	__u64 now = bpf_ktime_get_ns(), last = nat_stamp(&v->last_seen_ns), got;

	if (last == NAT_CLAIMED)
		return NAT_CLAIMED;
	/* A new flag (a FIN or RST: the pair is closing) stamps the time at
	 * once, so a closed pair's linger counts from its close. */
	if (flags & ~v->flags) {
		v->flags |= flags;
	} else if (nat_age(now, last) <= (__s64)NAT_REFRESH_NS) {
		return last;
	}
	got = atomic_cas64(&v->last_seen_ns, last, now);
	return got == last ? now : got;
}

/* nat_still_v4/v6 says whether entry v, found at key k, still held k's
 * pair when the caller read what it uses of it (after stamp, the value
 * nat_touch returned or the caller read first): a preallocated map reuses
 * a deleted entry's element at once, and a value read after a concurrent
 * delete may be another key's (another pod's address). Unchanged stamp:
 * yes; changed: the key is looked up again, and a claimed entry is
 * another party's. */
static __always_inline int FAM(nat_still)(const FAM_T(nat, key) *k, FAM_T(nat, val) *v, __u64 stamp)
{
	__u64 now = nat_stamp(&v->last_seen_ns);

	if (now == stamp)
		return stamp != NAT_CLAIMED;
	return now != NAT_CLAIMED && bpf_map_lookup_elem(&FAM(nat), k) == v;
}

/* nat_pair_v4/v6 is the key of the other direction of an entry (dir 0 <-> 1). */
static __always_inline void FAM(nat_pair)(const FAM_T(nat, key) *k, const FAM_T(nat, val) *v,
					  FAM_T(nat, key) *peer)
{
	__builtin_memset(peer, 0, sizeof(*peer));
	peer->proto = k->proto;
	if (k->dir == DIR_EGRESS) {
		FAM_ADDR_COPY(peer->src, k->dst);
		FAM_ADDR_COPY(peer->dst, v->addr);
		peer->sport = k->dport;
		peer->dport = v->port;
		peer->dir = DIR_INGRESS;
	} else {
		FAM_ADDR_COPY(peer->src, v->addr);
		FAM_ADDR_COPY(peer->dst, k->src);
		peer->sport = v->port;
		peer->dport = k->sport;
		peer->dir = DIR_EGRESS;
	}
}

/* nat_established_v4/v6 handles an egress packet of a pair whose dir-0 entry v
 * exists. Cheap for most packets; once a second per pair, and for every SYN,
 * it checks the reply entry: one lost is put back, one taken by another
 * flow ends this pair (NAT_EST_NO_PAIR). A SYN on a closed or expired pair
 * reopens it once it has claimed it (else NAT_EST_DROP: the pair is being
 * ended or reopened by another party), unless the tuple's new flow would
 * not be masqueraded now (renew: the source is no longer a masquerade
 * source, or the config no longer masquerades the destination): then the
 * claimed pair is ended, both halves, and the packet has no pair
 * (NAT_EST_NO_PAIR), as conntrack makes a new entry and decides again. The
 * source's first FIN, before any
 * from the remote, records where it ends (see "Who closed first"). */
GLOBAL_FUNC int FAM(nat_established)(struct __sk_buff *skb, const FAM_T(nat, key) *k, FAM_T(nat, val) *v,
				    const struct pkt *p, int renew)
{
	struct masq_config *cfg;
	__u8 flags;
	FAM_T(nat, key) peer, *key;
	FAM_T(nat, val) *r, nr = {};
	FAM_T(nat, scratch) *s;
	__u64 now = bpf_ktime_get_ns(), rl;
	__u32 end, zero = 0;

	if (!skb || !k || !v || !p)
		return 0;
	flags = p->tcp_flags & (NAT_F_FIN | NAT_F_RST);
	/* What the pod sent, for the RSTs of both sides (see "RSTs"); a RST
	 * itself moves nothing. */
	if (k->proto == IPPROTO_TCP && !(flags & NAT_F_RST))
		tcp_seen(&v->tcp_end, p, 0);
	/* A new FIN or RST takes the slow path: the first FIN needs the reply
	 * entry's flags to tell who closed first. */
	if (!tcp_syn(p) && !(flags & ~v->flags) && nat_age(now, v->last_seen_ns) <= (__s64)NAT_REFRESH_NS)
		return 0;
	/* k as a map key, copied (maps.h: nat_scratch_v4) */
	s = bpf_map_lookup_elem(&FAM(nat_scratch), &zero);
	if (!s)
		return 0;
	s->key = *k;
	key = &s->key;
	FAM(nat_pair)(k, v, &peer);
	r = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (!r) {
		/* Rebuilt from nothing: no flag of the lost entry (a FIN of an
		 * earlier connection) carries over. */
		FAM_ADDR_COPY(nr.addr, k->src);
		nr.port = k->sport;
		nr.last_seen_ns = now;
		nr.created_ns = v->created_ns;
		if (FAM(nat_insert)(&peer, &nr) == 0) {
			/* Whoever ends a pair deletes its egress entry before
			 * its reply entry: with the reply entry gone, the
			 * egress entry (v may be a pointer to it, deleted) may
			 * be gone too, and the rebuilt entry would be alone. */
			if (!bpf_map_lookup_elem(&FAM(nat), key)) {
				FAM(nat_delete)(&peer);
				return NAT_EST_NO_PAIR;
			}
			FAM(nat_touch)(v, flags);
			return 0;
		}
		r = bpf_map_lookup_elem(&FAM(nat), &peer);
		if (!r)
			return 0;
	}
	if (!FAM_ADDR_EQ(r->addr, k->src) || r->port != k->sport) {
		FAM(nat_delete)(key);
		return NAT_EST_NO_PAIR;
	}
	/* A stream from now on: may not go for a new flow, its note armed
	 * (evict.h) by the caller (a frame more here would take the IPv6
	 * egress chain's stack over 512 bytes before 6.6). The rest of this
	 * function is a UDP packet's touch. */
	if (nat_udp_stream(k->proto, &r->flags, r->created_ns) && !(r->flags & NAT_F_HOST)) {
		rl = nat_stamp(&r->last_seen_ns);
		if (rl != NAT_CLAIMED && FAM(nat_cand_mark_set)(&peer, r->created_ns, rl | NAT_NOTE_ARMED)) {
			FAM(nat_touch)(v, flags);
			return NAT_EST_ARM;
		}
	}
	cfg = masq_cfg();
	rl = nat_stamp(&r->last_seen_ns);
	if (tcp_syn(p) && cfg &&
	    (nat_closed(v->flags, r->flags) ||
	     nat_expired(cfg, k->proto, v->flags | r->flags, nat_later(v->last_seen_ns, rl), now))) {
		/* The claim: another CPU's takeover, early drop or the
		 * collector may be ending this pair at the same instant. */
		if (!nat_claim(&r->last_seen_ns, rl, renew ? NAT_CLAIMED : now))
			return NAT_EST_DROP;
		/* A new flow of the tuple that is not masqueraded now: the old
		 * pair goes (its egress entry would translate the new flow's
		 * next packets). */
		if (renew) {
			FAM(nat_delete)(key);
			FAM(nat_delete)(&peer);
			return NAT_EST_NO_PAIR;
		}
		NAT_RESET(v, now);
		NAT_RESET(r, now);
		FAM(nat_cand_note)(&peer, now); /* a new flow: early drop may take it */
		count(COUNTER_NAT_REOPENED);
		return 0;
	}
	/* The pod's RST ends an established pair only at a sequence number
	 * the remote expects (see "RSTs"); it is translated either way. */
	if ((flags & ~v->flags & NAT_F_RST) && k->proto == IPPROTO_TCP && (r->flags & NAT_F_SEEN) &&
	    !((r->flags | v->flags) & (NAT_F_FIN | NAT_F_RST)) &&
	    !tcp_rst_from_pod(p->tcp_end, v->tcp_end)) {
		flags &= ~NAT_F_RST;
		count(COUNTER_TCP_RST_IGNORED);
	}
	/* The pod's first RST that ends the pair: the pair is reset, and
	 * may go for a new flow (pressure.h judges it by its reply entry,
	 * which gets the RST too), noted for early drop (evict.h). */
	if ((flags & ~v->flags & NAT_F_RST) && k->proto == IPPROTO_TCP && !(r->flags & (NAT_F_RST | NAT_F_HOST))) {
		r->flags |= NAT_F_RST;
		FAM(nat_cand_note)(&peer, r->created_ns);
	}
	/* The source's FIN before any from the remote: whether the remote
	 * then closes passively is its FIN's to say (FAM(nat_reply_fin)). */
	if ((flags & NAT_F_FIN) && k->proto == IPPROTO_TCP && !(v->flags & NAT_F_FIN) &&
	    !((r->flags | v->flags) & (NAT_F_RST | NAT_F_FIN))) {
		end = tcp_fin_end(skb, p);
		if (end)
			bpf_map_update_elem(&FAM(nat_fin), &peer, &end, BPF_ANY);
	}
	FAM(nat_touch)(v, flags);
	return 0;
}

/* nat_reply_fin_v4/v6 handles the remote's first FIN on the pair whose
 * reply entry (key k, value v) it matched: when the source's FIN came first
 * and this one acknowledges it, the remote closed passively, and the pair
 * is NAT_F_CLOSED_FIRST (its port may go to another source after the
 * linger); crossing FINs leave the remote in TIME_WAIT, and no mark.
 * Returns 0 (a global function returns a scalar). */
GLOBAL_FUNC int FAM(nat_reply_fin)(struct __sk_buff *skb, const FAM_T(nat, key) *k, const FAM_T(nat, val) *v,
				   const struct pkt *p)
{
	FAM_T(nat, key) peer, key;
	FAM_T(nat, val) *o;
	__u32 *end, ack;

	if (!skb || !k || !v || !p)
		return 0;
	key = *k; /* a map key (lib/compat.h: "Keys") */
	end = bpf_map_lookup_elem(&FAM(nat_fin), &key);
	if (!end)
		return 0;
	FAM(nat_pair)(k, v, &peer);
	o = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (o && FAM_ADDR_EQ(o->addr, k->dst) && o->port == k->dport && (o->flags & NAT_F_FIN) &&
	    !((o->flags | v->flags) & NAT_F_RST) && tcp_ack_of(skb, p, &ack) == 0 &&
	    (__s32)(ack - *end) >= 0)
		o->flags |= NAT_F_CLOSED_FIRST;
	bpf_map_delete_elem(&FAM(nat_fin), &key);
	return 0;
}

/* nat_reply_rst_v4/v6 says whether the remote's RST p, which matched the
 * reply entry (key k, value v) of an established pair, ends it: 1 when its
 * sequence number is the one the pod expects or the pair is closing (see
 * "RSTs"), else 0 (counted). Returns a scalar (a global function). */
GLOBAL_FUNC int FAM(nat_reply_rst)(const FAM_T(nat, key) *k, const FAM_T(nat, val) *v, const struct pkt *p)
{
	FAM_T(nat, key) peer;
	FAM_T(nat, val) *o;

	if (!k || !v || !p)
		return 1;
	FAM(nat_pair)(k, v, &peer);
	o = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (!o || ((o->flags | v->flags) & (NAT_F_FIN | NAT_F_RST)) ||
	    tcp_rst_from_remote(p->tcp_end, v->tcp_end))
		return 1;
	count(COUNTER_TCP_RST_IGNORED);
	return 0;
}

/* nat_reply_syn_v4/v6 handles the remote's SYN-ACK p on an answered pair
 * whose reply entry (key k, value v) it matched: a new connection on the
 * pod's tuple (the pod's SYN restarted its own end, see "RSTs") is in
 * another sequence space, which the remote's tcp_end, moving by at most
 * NAT_TCP_WINDOW, would never reach: its RSTs would be ignored and the pair
 * kept established for days. As conntrack re-inits on a SYN-ACK that
 * acknowledges the SYN it ignored, the remote's end starts anew when the
 * SYN-ACK acknowledges the pod's SYN (its ACK is the pod's end): a forger
 * must guess the pod's initial sequence number. Returns 0 (a global
 * function returns a scalar). */
GLOBAL_FUNC int FAM(nat_reply_syn)(struct __sk_buff *skb, const FAM_T(nat, key) *k, FAM_T(nat, val) *v,
				   const struct pkt *p)
{
	FAM_T(nat, key) peer;
	FAM_T(nat, val) *o;
	__u32 ack;

	if (!skb || !k || !v || !p)
		return 0;
	FAM(nat_pair)(k, v, &peer);
	o = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (o && o->tcp_end && tcp_ack_of(skb, p, &ack) == 0 && ack == o->tcp_end)
		v->tcp_end = p->tcp_end;
	return 0;
}

/* nat_takeover_v4/v6 says whether the NAT tuple in, whose reply entry r
 * exists, may be given to a new flow from src: its pair expired (conntrack
 * would have let it go), lost its other half, or (closed: the search's
 * last, harder probes) is a closed TCP pair, 2 s after its close, of the
 * same source address (whose TCP timestamps keep increasing toward this
 * server, so the server's TIME_WAIT socket accepts the new SYN: no PAWS
 * drop) or whose source closed first (NAT_F_CLOSED_FIRST: the server closed
 * passively and holds no TIME_WAIT). A reusable pair is claimed (see
 * NAT_CLAIMED: no other CPU takes it too) and its old dir-0 entry deleted;
 * the caller then owns the reply entry: it replaces or deletes it. */
static __always_inline int FAM(nat_takeover)(const FAM_T(nat, key) *in, FAM_T(nat, val) *r,
					     const FAM_ADDR src, __u64 now, int closed)
{
	struct masq_config *cfg = masq_cfg();
	FAM_T(nat, key) peer;
	FAM_T(nat, val) *o;
	__u64 last, rl, ol;

	if (!cfg)
		return 0;
	rl = nat_stamp(&r->last_seen_ns);
	/* r may be another key's element by now (deleted and reused: its
	 * claim would succeed from that key's own stamp); checked after the
	 * stamp is read, the claim fails if it changes later. */
	if (bpf_map_lookup_elem(&FAM(nat), in) != r)
		return 0;
	if (r->flags & NAT_F_HOST)
		return nat_expired(cfg, in->proto, r->flags, rl, now) &&
		       nat_claim(&r->last_seen_ns, rl, NAT_CLAIMED) ? NAT_REUSE_CLAIMED : 0;
	FAM(nat_pair)(in, r, &peer);
	o = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (!o || !FAM_ADDR_EQ(o->addr, in->dst) || o->port != in->dport)
		/* half a pair: reusable unless another CPU is creating it */
		return !nat_being_made(now, r->created_ns) &&
		       nat_claim(&r->last_seen_ns, rl, NAT_CLAIMED) ? NAT_REUSE_CLAIMED : 0;
	ol = nat_stamp(&o->last_seen_ns);
	last = nat_later(ol, rl);
	if (!nat_expired(cfg, in->proto, o->flags | r->flags, last, now) &&
	    !(closed && in->proto == IPPROTO_TCP && (FAM_ADDR_EQ(r->addr, src) || (o->flags & NAT_F_CLOSED_FIRST)) &&
	      nat_closed(o->flags, r->flags) && nat_age(now, last) > (__s64)NAT_CLOSED_LINGER_NS))
		return 0;
	if (!nat_claim(&r->last_seen_ns, rl, NAT_CLAIMED))
		return 0;
	FAM(nat_delete)(&peer);
	return NAT_REUSE_CLAIMED;
}

/* nat_use_v4/v6 copies the translation of entry v (found at key k) into
 * *to, and says whether it was still k's (nat_still). Its own frame: the
 * egress program's stack is near the limit. */
static __noinline __attribute__((unused)) int FAM(nat_use)(const FAM_T(nat, key) *k, FAM_T(nat, val) *v,
							   FAM_T(nat, val) *to)
{
	__u64 stamp = nat_stamp(&v->last_seen_ns);

	FAM_ADDR_COPY(to->addr, v->addr);
	to->port = v->port;
	return FAM(nat_still)(k, v, stamp);
}

#undef FAMILY
#include "family.h"
