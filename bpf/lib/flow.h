/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Flow state: the lifetimes of NAT pairs and keeping both halves of a pair. */

#ifndef IPMASQ_LIB_FLOW_H
#define IPMASQ_LIB_FLOW_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"

/* last_seen_ns is written at most this often per entry: the collector's
 * timeouts are tens of seconds, and a write per packet would bounce the
 * entry's cache line between CPUs. */
#define NAT_REFRESH_NS	1000000000ULL

/*
 * Claims. Four parties end or rebuild a pair: a SYN reopening it, a new
 * flow taking over its port, early drop, and the agent's collector
 * (nat_gc_v4/v6, run by the agent). Each first claims the pair's reply
 * (dir 1) entry: a compare-and-swap of its last_seen_ns from the value it
 * judged to NAT_CLAIMED (or to now, for a reopen). Only one party's swap
 * from a given value succeeds, and a claimed entry is neither expired nor
 * reusable for the others, so two CPUs never both take one NAT tuple, and
 * the collector never deletes a pair a SYN has just reopened or taken. A
 * half pair (no reply entry) is claimed on its own entry.
 *
 * Time differences are signed: now is read before other CPUs may stamp an
 * entry, so an entry may look stamped in this CPU's future.
 */
#define NAT_CLAIMED	0x7fffffffffffffffULL

/* nat_age is how long ago (ns) stamp was, as of now: negative when another
 * CPU stamped the entry after this one read now, or for a claimed entry. */
static __always_inline __s64 nat_age(__u64 now, __u64 stamp)
{
	return (__s64)(now - stamp);
}

/* nat_later is the later of two stamps (a claimed one is the latest). */
static __always_inline __u64 nat_later(__u64 a, __u64 b)
{
	return (__s64)(a - b) > 0 ? a : b;
}

/* nat_claim swaps *stamp from seen (the value the caller judged) to to, and
 * says whether this caller won. */
static __always_inline int nat_claim(__u64 *stamp, __u64 seen, __u64 to)
{
	return seen != NAT_CLAIMED && __sync_val_compare_and_swap(stamp, seen, to) == seen;
}

/* nat_stamp reads a stamp once (the judgment and the claim use one value). */
static __always_inline __u64 nat_stamp(const __u64 *stamp)
{
	return *(const volatile __u64 *)stamp;
}

/*
 * Like conntrack, a pair lives as long as its state allows without a packet:
 * an unanswered SYN briefly, an established TCP flow long, a closing or reset
 * one briefly again. The state is derived from the flags both directions
 * recorded (FIN and RST per direction, SEEN once the remote answered). The
 * programs apply the lifetimes themselves, when a SYN meets an old pair and
 * when a NAT port is wanted, so that nothing waits for the agent's collector
 * (which only frees the memory of expired pairs, and may be down).
 */

/* A closed TCP pair's port goes to a new flow of the same source only after
 * this long since the pair closed (the FIN or RST stamps last_seen_ns at
 * once), so the last ACK of the old connection still finds its pair. */
#define NAT_CLOSED_LINGER_NS	2000000000ULL

/* flow_start says whether p may start a flow in direction dir: a SYN without
 * ACK, any UDP datagram, an ICMP echo request. */
static __always_inline int flow_start(const struct pkt *p, int dir)
{
	switch (p->proto) {
	case IPPROTO_TCP:
		return (p->tcp_flags & (PKT_F_SYN | PKT_F_ACK)) == PKT_F_SYN;
	case IPPROTO_UDP:
		return 1;
	}
	/* egress PKT_PORTS: echo request; ingress PKT_ECHO_INBOUND: echo request */
	return dir == DIR_EGRESS ? p->kind == PKT_PORTS : p->kind == PKT_ECHO_INBOUND;
}

static __always_inline int tcp_syn(const struct pkt *p)
{
	return p->proto == IPPROTO_TCP && flow_start(p, DIR_EGRESS);
}

/* nat_state is the state of a pair from the flags of both its directions. */
static __always_inline __u32 nat_state(__u8 proto, __u8 flags)
{
	switch (proto) {
	case IPPROTO_TCP:
		if (flags & NAT_F_RST)
			return NAT_TCP_RESET;
		if (flags & NAT_F_FIN)
			return NAT_TCP_CLOSING;
		return flags & NAT_F_SEEN ? NAT_TCP_ESTABLISHED : NAT_TCP_SYN;
	case IPPROTO_UDP:
		return flags & NAT_F_STREAM ? NAT_UDP_STREAM : NAT_UDP;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		return NAT_ICMP;
	}
	return NAT_OTHER;
}

/* A UDP flow answered and still active this long after it started is a
 * stream (conntrack's stream_ts: 2 s): it lives the replied lifetime; a
 * query and its answer live the short one and stay early-droppable. */
#define NAT_STREAM_NS	2000000000ULL

/* nat_udp_stream marks the dir-1 entry r of a UDP pair a stream when a
 * packet of the pair passes after an earlier answer (SEEN) and 2 s after
 * the pair started. Costs a clock read only for answered, not yet stream
 * UDP pairs. */
static __always_inline void nat_udp_stream(__u8 proto, __u8 *flags, __u64 created)
{
	if (proto == IPPROTO_UDP && (*flags & (NAT_F_SEEN | NAT_F_STREAM)) == NAT_F_SEEN &&
	    nat_age(bpf_ktime_get_ns(), created) > (__s64)NAT_STREAM_NS)
		*flags |= NAT_F_STREAM;
}

/* nat_expired says whether a pair last seen at last has outlived its state. */
static __always_inline int nat_expired(const struct masq_config *cfg, __u8 proto, __u8 flags,
				       __u64 last, __u64 now)
{
	__u32 state = nat_state(proto, flags);
	__u64 lifetime;

	if (state >= NAT_STATE_MAX)
		return 0;
	lifetime = cfg->timeout_ns[state];
	return lifetime && nat_age(now, last) > (__s64)lifetime;
}

/* nat_closed: both sides sent a FIN, or one a RST (out: the source's side's
 * flags, in: the remote's). */
static __always_inline int nat_closed(__u8 out, __u8 in)
{
	return ((out | in) & NAT_F_RST) || ((out & in) & NAT_F_FIN);
}

static __always_inline void nat_touch_v4(struct nat_v4_val *v, __u8 flags)
{
	__u64 now = bpf_ktime_get_ns();

	/* A new flag (a FIN or RST: the pair is closing) stamps the time at
	 * once, so a closed pair's linger counts from its close. */
	if (flags & ~v->flags) {
		v->flags |= flags;
		if (v->last_seen_ns != NAT_CLAIMED)
			v->last_seen_ns = now;
		return;
	}
	if (nat_age(now, v->last_seen_ns) > (__s64)NAT_REFRESH_NS)
		v->last_seen_ns = now;
}

static __always_inline void nat_touch_v6(struct nat_v6_val *v, __u8 flags)
{
	__u64 now = bpf_ktime_get_ns();

	/* A new flag (a FIN or RST: the pair is closing) stamps the time at
	 * once, so a closed pair's linger counts from its close. */
	if (flags & ~v->flags) {
		v->flags |= flags;
		if (v->last_seen_ns != NAT_CLAIMED)
			v->last_seen_ns = now;
		return;
	}
	if (nat_age(now, v->last_seen_ns) > (__s64)NAT_REFRESH_NS)
		v->last_seen_ns = now;
}

/* Restart an entry's life as a new flow's (a reopened pair). */
#define NAT_RESET(v, now) do {		\
	(v)->flags = 0;			\
	(v)->created_ns = (now);	\
	(v)->last_seen_ns = (now);	\
} while (0)

/* nat_pair_v4 is the key of the other direction of an entry (dir 0 <-> 1). */
static __always_inline void nat_pair_v4(const struct nat_v4_key *k, const struct nat_v4_val *v,
					struct nat_v4_key *peer)
{
	__builtin_memset(peer, 0, sizeof(*peer));
	peer->proto = k->proto;
	if (k->dir == DIR_EGRESS) {
		peer->src = k->dst;
		peer->dst = v->addr;
		peer->sport = k->dport;
		peer->dport = v->port;
		peer->dir = DIR_INGRESS;
	} else {
		peer->src = v->addr;
		peer->dst = k->src;
		peer->sport = v->port;
		peer->dport = k->sport;
		peer->dir = DIR_EGRESS;
	}
}

static __always_inline void nat_pair_v6(const struct nat_v6_key *k, const struct nat_v6_val *v,
					struct nat_v6_key *peer)
{
	__builtin_memset(peer, 0, sizeof(*peer));
	peer->proto = k->proto;
	if (k->dir == DIR_EGRESS) {
		__builtin_memcpy(peer->src, k->dst, 16);
		__builtin_memcpy(peer->dst, v->addr, 16);
		peer->sport = k->dport;
		peer->dport = v->port;
		peer->dir = DIR_INGRESS;
	} else {
		__builtin_memcpy(peer->src, v->addr, 16);
		__builtin_memcpy(peer->dst, k->src, 16);
		peer->sport = v->port;
		peer->dport = k->sport;
		peer->dir = DIR_EGRESS;
	}
}

/* nat_established_v4/v6 results besides 0 (translate with the pair). */
#define NAT_EST_NO_PAIR	1	/* the caller treats the packet as having no pair */
#define NAT_EST_DROP	2	/* a SYN that lost the pair's claim: dropped (counted), the client retransmits */

/* nat_established_v4 handles an egress packet of a pair whose dir-0 entry v
 * exists. Cheap for most packets; once a second per pair, and for every SYN,
 * it checks the reply entry: one lost is put back, one taken by another
 * flow ends this pair (NAT_EST_NO_PAIR). A SYN on a closed or expired pair
 * reopens it once it has claimed it (else NAT_EST_DROP: the pair is being
 * ended or reopened by another party), unless the source is no longer a
 * masquerade source (NAT_EST_NO_PAIR). */
__noinline int nat_established_v4(const struct nat_v4_key *k, struct nat_v4_val *v,
				   const struct pkt *p, int former)
{
	struct masq_config *cfg;
	__u8 flags;
	struct nat_v4_key peer;
	struct nat_v4_val *r, nr = {};
	__u64 now = bpf_ktime_get_ns(), rl;

	if (!k || !v || !p)
		return 0;
	flags = p->tcp_flags & (NAT_F_FIN | NAT_F_RST);
	/* A new FIN or RST takes the slow path: the first FIN needs the reply
	 * entry's flags to tell who closed first. */
	if (!tcp_syn(p) && !(flags & ~v->flags) && nat_age(now, v->last_seen_ns) <= (__s64)NAT_REFRESH_NS)
		return 0;
	nat_pair_v4(k, v, &peer);
	r = bpf_map_lookup_elem(&nat_v4, &peer);
	if (!r) {
		nr.addr = k->src;
		nr.port = k->sport;
		nr.last_seen_ns = now;
		nr.created_ns = v->created_ns;
		if (bpf_map_update_elem(&nat_v4, &peer, &nr, BPF_NOEXIST) == 0) {
			nat_touch_v4(v, flags);
			return 0;
		}
		r = bpf_map_lookup_elem(&nat_v4, &peer);
		if (!r)
			return 0;
	}
	if (r->addr != k->src || r->port != k->sport) {
		bpf_map_delete_elem(&nat_v4, k);
		return NAT_EST_NO_PAIR;
	}
	nat_udp_stream(k->proto, &r->flags, r->created_ns);
	cfg = masq_cfg();
	rl = nat_stamp(&r->last_seen_ns);
	if (tcp_syn(p) && cfg &&
	    (nat_closed(v->flags, r->flags) ||
	     nat_expired(cfg, k->proto, v->flags | r->flags, nat_later(v->last_seen_ns, rl), now))) {
		/* A new flow of the tuple: one of a source that is no longer
		 * a masquerade source is not masqueraded (conntrack makes a new
		 * entry, and decides again). */
		if (former)
			return NAT_EST_NO_PAIR;
		/* The claim: another CPU's takeover, early drop or the
		 * collector may be ending this pair at the same instant. */
		if (!nat_claim(&r->last_seen_ns, rl, now))
			return NAT_EST_DROP;
		NAT_RESET(v, now);
		NAT_RESET(r, now);
		count(COUNTER_NAT_REOPENED);
		return 0;
	}
	/* The source's FIN before any from the remote: the remote closes
	 * passively and keeps no TIME_WAIT for this tuple. */
	if ((flags & NAT_F_FIN) && !(v->flags & NAT_F_FIN) && !((r->flags | v->flags) & NAT_F_RST) &&
	    !(r->flags & NAT_F_FIN))
		flags |= NAT_F_CLOSED_FIRST;
	nat_touch_v4(v, flags);
	return 0;
}

__noinline int nat_established_v6(const struct nat_v6_key *k, struct nat_v6_val *v,
				   const struct pkt *p, int former)
{
	struct masq_config *cfg;
	__u8 flags;
	struct nat_v6_key peer;
	struct nat_v6_val *r, nr = {};
	__u64 now = bpf_ktime_get_ns(), rl;

	if (!k || !v || !p)
		return 0;
	flags = p->tcp_flags & (NAT_F_FIN | NAT_F_RST);
	/* A new FIN or RST takes the slow path: the first FIN needs the reply
	 * entry's flags to tell who closed first. */
	if (!tcp_syn(p) && !(flags & ~v->flags) && nat_age(now, v->last_seen_ns) <= (__s64)NAT_REFRESH_NS)
		return 0;
	nat_pair_v6(k, v, &peer);
	r = bpf_map_lookup_elem(&nat_v6, &peer);
	if (!r) {
		__builtin_memcpy(nr.addr, k->src, 16);
		nr.port = k->sport;
		nr.last_seen_ns = now;
		nr.created_ns = v->created_ns;
		if (bpf_map_update_elem(&nat_v6, &peer, &nr, BPF_NOEXIST) == 0) {
			nat_touch_v6(v, flags);
			return 0;
		}
		r = bpf_map_lookup_elem(&nat_v6, &peer);
		if (!r)
			return 0;
	}
	if (!addr6_equal(r->addr, k->src) || r->port != k->sport) {
		bpf_map_delete_elem(&nat_v6, k);
		return NAT_EST_NO_PAIR;
	}
	nat_udp_stream(k->proto, &r->flags, r->created_ns);
	cfg = masq_cfg();
	rl = nat_stamp(&r->last_seen_ns);
	if (tcp_syn(p) && cfg &&
	    (nat_closed(v->flags, r->flags) ||
	     nat_expired(cfg, k->proto, v->flags | r->flags, nat_later(v->last_seen_ns, rl), now))) {
		/* A new flow of the tuple: one of a source that is no longer
		 * a masquerade source is not masqueraded (conntrack makes a new
		 * entry, and decides again). */
		if (former)
			return NAT_EST_NO_PAIR;
		/* The claim: another CPU's takeover, early drop or the
		 * collector may be ending this pair at the same instant. */
		if (!nat_claim(&r->last_seen_ns, rl, now))
			return NAT_EST_DROP;
		NAT_RESET(v, now);
		NAT_RESET(r, now);
		count(COUNTER_NAT_REOPENED);
		return 0;
	}
	/* The source's FIN before any from the remote: the remote closes
	 * passively and keeps no TIME_WAIT for this tuple. */
	if ((flags & NAT_F_FIN) && !(v->flags & NAT_F_FIN) && !((r->flags | v->flags) & NAT_F_RST) &&
	    !(r->flags & NAT_F_FIN))
		flags |= NAT_F_CLOSED_FIRST;
	nat_touch_v6(v, flags);
	return 0;
}

/* nat_reusable_v4/v6 results besides 0 (not reusable). */
#define NAT_REUSE_CLAIMED	1	/* claimed: replace the reply entry (BPF_ANY) */
#define NAT_REUSE_FREE		2	/* gone meanwhile: insert it (BPF_NOEXIST) */

/* nat_reusable_v4 says whether the NAT tuple in (a dir-1 key that exists)
 * may be given to a new flow from src: its pair expired, lost its other
 * half, or is a closed TCP pair (2 s after its close) of the same source
 * address (whose TCP timestamps keep increasing toward this server, so the
 * server's TIME_WAIT socket accepts the new SYN: no PAWS drop) or whose
 * source closed first (the server closed passively: no TIME_WAIT to
 * refuse another source's SYN). A reusable pair is claimed (see
 * NAT_CLAIMED: no other CPU takes it too) and its old dir-0 entry deleted;
 * the caller then owns the reply entry: it replaces or deletes it. */
__noinline int nat_reusable_v4(const struct nat_v4_key *in, __be32 src, __u64 now)
{
	struct masq_config *cfg = masq_cfg();
	struct nat_v4_key peer;
	struct nat_v4_val *r, *o;
	__u64 last, rl, ol;

	if (!in || !cfg)
		return 0;
	r = bpf_map_lookup_elem(&nat_v4, in);
	if (!r)
		return NAT_REUSE_FREE;
	rl = nat_stamp(&r->last_seen_ns);
	if (r->flags & NAT_F_HOST)
		return nat_expired(cfg, in->proto, r->flags, rl, now) &&
		       nat_claim(&r->last_seen_ns, rl, NAT_CLAIMED);
	nat_pair_v4(in, r, &peer);
	o = bpf_map_lookup_elem(&nat_v4, &peer);
	if (!o || o->addr != in->dst || o->port != in->dport)
		/* half a pair: reusable unless another CPU is creating it */
		return nat_age(now, r->created_ns) > (__s64)NAT_REFRESH_NS &&
		       nat_claim(&r->last_seen_ns, rl, NAT_CLAIMED);
	ol = nat_stamp(&o->last_seen_ns);
	last = nat_later(ol, rl);
	if (!nat_expired(cfg, in->proto, o->flags | r->flags, last, now) &&
	    !(in->proto == IPPROTO_TCP && (r->addr == src || (o->flags & NAT_F_CLOSED_FIRST)) &&
	      nat_closed(o->flags, r->flags) && nat_age(now, last) > (__s64)NAT_CLOSED_LINGER_NS))
		return 0;
	if (!nat_claim(&r->last_seen_ns, rl, NAT_CLAIMED))
		return 0;
	bpf_map_delete_elem(&nat_v4, &peer);
	return NAT_REUSE_CLAIMED;
}

/* Inlined into nat_create_v6: a call of its own would take the IPv6 egress
 * path's stack over 512 bytes. */
static __always_inline int nat_reusable_v6(const struct nat_v6_key *in, const struct nat_v6_key *out,
					   __u64 now)
{
	struct masq_config *cfg = masq_cfg();
	struct nat_v6_key peer;
	struct nat_v6_val *r, *o;
	__u64 rl, ol;

	if (!in || !out || !cfg)
		return 0;
	r = bpf_map_lookup_elem(&nat_v6, in);
	if (!r)
		return NAT_REUSE_FREE;
	if (r->flags & NAT_F_HOST) {
		rl = nat_stamp(&r->last_seen_ns);
		return nat_expired(cfg, in->proto, r->flags, rl, now) &&
		       nat_claim(&r->last_seen_ns, rl, NAT_CLAIMED);
	}
	nat_pair_v6(in, r, &peer);
	o = bpf_map_lookup_elem(&nat_v6, &peer);
	if (!o || !addr6_equal(o->addr, in->dst) || o->port != in->dport)
		return nat_age(now, r->created_ns) > (__s64)NAT_REFRESH_NS &&
		       nat_claim(&r->last_seen_ns, nat_stamp(&r->last_seen_ns), NAT_CLAIMED);
	rl = nat_stamp(&r->last_seen_ns);
	ol = nat_stamp(&o->last_seen_ns);
	if (!nat_expired(cfg, in->proto, o->flags | r->flags, nat_later(ol, rl), now) &&
	    !(in->proto == IPPROTO_TCP && (addr6_equal(r->addr, out->src) || (o->flags & NAT_F_CLOSED_FIRST)) &&
	      nat_closed(o->flags, r->flags) && nat_age(now, nat_later(ol, rl)) > (__s64)NAT_CLOSED_LINGER_NS))
		return 0;
	if (!nat_claim(&r->last_seen_ns, rl, NAT_CLAIMED))
		return 0;
	bpf_map_delete_elem(&nat_v6, &peer);
	return NAT_REUSE_CLAIMED;
}

#endif /* IPMASQ_LIB_FLOW_H */
