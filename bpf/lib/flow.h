/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Flow state: the lifetimes of NAT pairs and keeping both halves of a pair. */

#ifndef IPMASQ_LIB_FLOW_H
#define IPMASQ_LIB_FLOW_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "compat.h"
#include "counters.h"
#include "maps.h"
#include "natcount.h"
#include "parse.h"
#include "evict.h"

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
	return seen != NAT_CLAIMED && atomic_cas64(stamp, seen, to) == seen;
}

/* nat_stamp reads a stamp once (the judgment and the claim use one value). */
static __always_inline __u64 nat_stamp(const __u64 *stamp)
{
	return *(const volatile __u64 *)stamp;
}

/* nat_being_made says whether a reply entry without its egress entry,
 * created at created, may be a pair another CPU is making (the reply entry
 * goes in first): for a second it is not taken over, collected or dropped,
 * whatever its lifetime says. */
static __always_inline int nat_being_made(__u64 now, __u64 created)
{
	return nat_age(now, created) <= (__s64)NAT_REFRESH_NS;
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
 * the pair started, and says whether it did: the pair may no longer go
 * for a new flow, and the caller arms its note (evict.h). Costs a clock
 * read only for answered, not yet stream UDP pairs. */
static __always_inline int nat_udp_stream(__u8 proto, __u8 *flags, __u64 created)
{
	if (proto == IPPROTO_UDP && (*flags & (NAT_F_SEEN | NAT_F_STREAM)) == NAT_F_SEEN &&
	    nat_age(bpf_ktime_get_ns(), created) > (__s64)NAT_STREAM_NS) {
		*flags |= NAT_F_STREAM;
		return 1;
	}
	return 0;
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

/* Restart an entry's life as a new flow's (a reopened pair). */
#define NAT_RESET(v, now) do {		\
	(v)->flags = 0;			\
	(v)->created_ns = (now);	\
	(v)->last_seen_ns = (now);	\
	(v)->tcp_end = 0;		\
} while (0)

/* nat_established_v4/v6 results besides 0 (translate with the pair). */
#define NAT_EST_NO_PAIR	1	/* the caller treats the packet as having no pair */
#define NAT_EST_DROP	2	/* a SYN that lost the pair's claim: dropped (counted), the client retransmits */
#define NAT_EST_ARM	3	/* as 0, and the caller runs nat_cand_mark_run (set: a UDP stream's note armed) */

/*
 * RSTs. Like conntrack (nf_conntrack_proto_tcp.c), a RST from the remote
 * ends an established pair only when its sequence number is one the pod
 * expects: the end of what the remote sent (the pod's RCV.NXT once the data
 * that passed has arrived; the RST of a remote that aborts after data the
 * pod has not acknowledged yet: conntrack's "RST train"). Any other RST (a
 * blind one, forged off the path with a guessed sequence number) leaves the
 * pair as it was; it is still translated and delivered, so the pod judges
 * it too (RFC 5961: dropped, or answered with a challenge ACK, whose answer
 * from a remote that lost the connection is a RST at that end). The pod's
 * own RST ends the pair when its sequence number is within NAT_TCP_WINDOW
 * at or below the end of what the pod sent (its SND.NXT, or the
 * acknowledgment of a segment it refuses): the pod is no forger, but a RST
 * the remote would ignore must not end the pair of a connection the remote
 * keeps.
 *
 * Each direction's entry keeps the end of what that direction sent
 * (tcp_end), written by that direction's program on its own entry, only
 * when it moves. The remote's segments may be forged, so its tcp_end moves
 * forward by at most NAT_TCP_WINDOW a segment (no segment carries more): a
 * forged one must land that close to the real sequence number, as
 * conntrack's must land in the window, before a forged RST at its end
 * counts. Before the pair is answered, once it is closing, and while a
 * direction has not been seen (0: a pair picked up mid-stream, or kept from
 * before the upgrade that added the field), any RST counts, as conntrack
 * lets any RST through in those states. Conntrack also ends the pair on a
 * RST at the pod's highest acknowledgment; tracking it costs a load on
 * every egress TCP packet (about 10 % of the established path's cost),
 * and the pod itself only accepts a RST at the end of what arrived.
 */
#define NAT_TCP_WINDOW	(1U << 20)

/* tcp_seen moves a direction's tcp_end forward to packet p's; bounded: by
 * at most NAT_TCP_WINDOW (the remote's). The pod's SYN starts it anew (a
 * new connection of the tuple: another sequence space). Stores only on
 * change. */
static __always_inline void tcp_seen(__u32 *end, const struct pkt *p, int bounded)
{
	__s32 d = (__s32)(p->tcp_end - *end);

	if (!*end || (!bounded && (p->tcp_flags & (PKT_F_SYN | PKT_F_ACK)) == PKT_F_SYN) ||
	    (d > 0 && (!bounded || d <= (__s32)NAT_TCP_WINDOW)))
		*end = p->tcp_end;
}

/* tcp_rst_from_remote says whether the remote's RST with sequence number
 * seq (its tcp_end: a RST carries no data) ends a pair: seq is the end of
 * what the remote sent, or that is unknown. */
static __always_inline int tcp_rst_from_remote(__u32 seq, __u32 remote_end)
{
	return !remote_end || seq == remote_end;
}

/* tcp_rst_from_pod says whether the pod's RST with sequence number seq
 * ends a pair: within NAT_TCP_WINDOW at or below the pod's end, or that end
 * unknown. */
static __always_inline int tcp_rst_from_pod(__u32 seq, __u32 pod_end)
{
	return !pod_end || (__u32)(pod_end - seq) <= NAT_TCP_WINDOW;
}

/* nat_reusable_v4/v6 results besides 0 (not reusable). */
#define NAT_REUSE_CLAIMED	1	/* claimed: replace the reply entry (BPF_ANY) */
#define NAT_REUSE_FREE		2	/* gone meanwhile: insert it (BPF_NOEXIST) */

/*
 * Who closed first. A server that closes actively (its FIN before it has
 * the pod's) keeps the tuple in TIME_WAIT for a minute and refuses another
 * source's SYN on it (PAWS): the pair's port must not go to another pod
 * before the closing lifetime ends. Only when the server's FIN acknowledges
 * the pod's FIN did the server close passively (CLOSE_WAIT, LAST_ACK, no
 * TIME_WAIT); crossing FINs (each sent before the other arrived) leave both
 * ends in TIME_WAIT. So the pod's first FIN records where it ends in the
 * sequence space (nat_fin_v4/v6, keyed by the pair's reply tuple), and the
 * server's first FIN marks the pair NAT_F_CLOSED_FIRST only when its ACK
 * covers that FIN.
 */

/* tcp_fin_end is the sequence number after the FIN segment p (what the
 * peer's ACK of it carries), read off the packet; 0 when unreadable (the
 * record is then not made: conservative). */
static __always_inline __u32 tcp_fin_end(struct __sk_buff *skb, const struct pkt *p)
{
	struct {
		__be32 seq;
		__be32 ack;
		__u8 doff;
	} h;
	__u32 hlen;

	if (bpf_skb_load_bytes(skb, p->l4_off + 4, &h, 9) < 0)
		return 0;
	hlen = (__u32)(h.doff >> 4) * 4;
	if (skb->len < p->l4_off + hlen)
		return 0;
	/* skb->len: a GSO segment's whole payload too */
	return bpf_ntohl(h.seq) + (skb->len - p->l4_off - hlen) + 1;
}

/* tcp_ack_of reads the acknowledgment number of TCP segment p. */
static __always_inline int tcp_ack_of(struct __sk_buff *skb, const struct pkt *p, __u32 *ack)
{
	__be32 a;

	if (!(p->tcp_flags & PKT_F_ACK) || bpf_skb_load_bytes(skb, p->l4_off + 8, &a, 4) < 0)
		return -1;
	*ack = bpf_ntohl(a);
	return 0;
}

#define FAMILY 4
#include "flow_fam.h"
#define FAMILY 6
#include "flow_fam.h"

/* nat_reusable_v4 says whether the NAT tuple in (a dir-1 key) may be given
 * to a new flow from src: free meanwhile (NAT_REUSE_FREE), or a pair that
 * is over (nat_takeover_v4, claimed: NAT_REUSE_CLAIMED). Node flows
 * (hostflow.h) ask it of the tuple they clash with. */
GLOBAL_FUNC int nat_reusable_v4(const struct nat_v4_key *in, __be32 src, __u64 now)
{
	struct nat_v4_key key;
	struct nat_v4_val *r;

	if (!in)
		return 0;
	key = *in; /* a map key (lib/compat.h: "Keys") */
	r = bpf_map_lookup_elem(&nat_v4, &key);
	if (!r)
		return NAT_REUSE_FREE;
	return nat_takeover_v4(&key, r, src, now, 1);
}

/* nat_reusable_v6 is nat_reusable_v4 for IPv6, of the source of out;
 * inlined: a call of its own would take the IPv6 egress path's stack over
 * 512 bytes. */
static __always_inline int nat_reusable_v6(const struct nat_v6_key *in, const struct nat_v6_key *out,
					   __u64 now)
{
	struct nat_v6_val *r;

	if (!in || !out)
		return 0;
	r = bpf_map_lookup_elem(&nat_v6, in);
	if (!r)
		return NAT_REUSE_FREE;
	return nat_takeover_v6(in, r, out->src, now, 1);
}

#endif /* IPMASQ_LIB_FLOW_H */
