/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The inbound flows of inbound.h for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: inbound_key_v4, inbound_key_v6, inbound_answer_v4,
 * inbound_answer_v6, inbound_track_v4, inbound_track_v6, inbound_reply_v4,
 * inbound_reply_v6.
 */

#include "family.h"

/* inbound_key_v4/v6 build an inbound record's key (dir 2): the masquerade
 * source's side first, whichever way the packet goes. */
static __always_inline void FAM(inbound_key)(const struct pkt *p, int dir, FAM_T(nat, key) *k)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->proto = p->proto;
	k->dir = DIR_INBOUND;
	if (dir == DIR_EGRESS) {
		FAM_ADDR_COPY(k->src, FAM_PKT(p).saddr);
		FAM_ADDR_COPY(k->dst, FAM_PKT(p).daddr);
		k->sport = p->sport;
		k->dport = p->dport;
	} else {
		FAM_ADDR_COPY(k->src, FAM_PKT(p).daddr);
		FAM_ADDR_COPY(k->dst, FAM_PKT(p).saddr);
		k->sport = p->dport;
		k->dport = p->sport;
	}
}

/* inbound_answer_v4/v6 says whether the ingress packet whose inbound key
 * is k answers a flow the masquerade source itself started unmasqueraded
 * (an unmasq record of the same tuple, lib/unmasq.h): a pod's query to a
 * resolver pod on another node of a directly routed network. Its answer
 * starts no inbound flow (conntrack has the pod's own entry for it). */
static __always_inline int FAM(inbound_answer)(FAM_T(nat, key) *k)
{
	int found;

	/* the same key as the record's but for dir (no copy: stack room) */
	k->dir = DIR_EGRESS;
	found = bpf_map_lookup_elem(&FAM(unmasq), k) != NULL;
	k->dir = DIR_INBOUND;
	return found;
}

/* inbound_track_v4/v6 record (or refresh, or reopen) the inbound flow of an
 * ingress packet that matched no NAT pair. Mid-stream TCP segments cost
 * nothing: only SYN, FIN and RST are looked at. A record is not assured
 * until the pod answers (pressure.h): made, or reopened, it is noted for
 * early drop (evict.h), and a full table makes room for it as for a new
 * pair. A reopen claims the record from the stamp it judged, as the other
 * parties do (lib/flow.h): a SYN that meets its record being ended by the
 * collector or early drop is dropped (the client retransmits it, and gets
 * a new record), and the claim stays theirs. Returns TC_ACT_SHOT for that
 * SYN, else TC_ACT_UNSPEC. */
static __always_inline int FAM(inbound_track)(struct __sk_buff *skb, const struct pkt *p)
{
	const struct masq_rule *rule;
	FAM_T(nat, val) *v, nv = {};
	struct masq_config *cfg;
	FAM_T(nat, key) k;
	__u64 now, seen;
	long ret;
	int arm;

	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & (PKT_F_SYN | NAT_F_FIN | NAT_F_RST)))
		return TC_ACT_UNSPEC;
	if (!FAM(masq_source)(skb, FAM_PKT(p).daddr, &rule))
		return TC_ACT_UNSPEC;
	FAM(inbound_key)(p, DIR_INGRESS, &k);
	now = bpf_ktime_get_ns();
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (v) {
		cfg = masq_cfg();
		seen = nat_stamp(&v->last_seen_ns);
		if (p->proto == IPPROTO_TCP && flow_start(p, DIR_INGRESS) && cfg &&
		    (v->flags & (NAT_F_FIN | NAT_F_RST) || nat_expired(cfg, k.proto, v->flags, seen, now))) {
			/* v may be another key's element by now (deleted and
			 * reused: the claim would succeed from that key's own
			 * stamp, and clear its flags); checked after the stamp
			 * is read, the claim fails if it changes later. */
			if (bpf_map_lookup_elem(&FAM(nat), &k) != v ||
			    !nat_claim(&v->last_seen_ns, seen, NAT_CLAIMED)) {
				count(COUNTER_DROP_PAIR_CLAIMED);
				return TC_ACT_SHOT;
			}
			/* Claimed while its flags are reset, stamped after: a
			 * collector that read the new stamp with the old flags
			 * (closing) would have judged it expired. */
			v->flags = 0;
			v->created_ns = now;
			*(volatile __u64 *)&v->last_seen_ns = now;
			FAM(nat_cand_note)(&k, now);
			return TC_ACT_UNSPEC;
		}
		/* a stream from now on: its note armed (evict.h) */
		arm = nat_udp_stream(k.proto, &v->flags, v->created_ns);
		/* The remote's first FIN or RST: the record may go for a new
		 * flow again (pressure.h), noted for early drop (evict.h). */
		if ((p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) && !(v->flags & (NAT_F_FIN | NAT_F_RST)))
			FAM(nat_cand_note)(&k, v->created_ns);
		seen = FAM(nat_touch)(v, p->tcp_flags & (NAT_F_FIN | NAT_F_RST));
		if (arm && seen != NAT_CLAIMED)
			FAM(nat_cand_mark)(&k, v->created_ns, seen | NAT_NOTE_ARMED);
		return TC_ACT_UNSPEC;
	}
	if (!flow_start(p, DIR_INGRESS) || FAM(inbound_answer)(&k))
		return TC_ACT_UNSPEC;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	ret = FAM(nat_insert)(&k, &nv);
	if (ret == -E2BIG && FAM(nat_early_drop)())
		ret = FAM(nat_insert)(&k, &nv);
	if (ret == 0) {
		FAM(nat_cand_note)(&k, now);
		count(COUNTER_INBOUND_NEW);
	}
	return TC_ACT_UNSPEC;
}

/* inbound_reply_v4/v6 say whether an egress packet without a NAT pair
 * answers a recorded inbound flow (and refresh the record). */
static __always_inline int FAM(inbound_reply)(const struct pkt *p)
{
	FAM_T(nat, val) *v;
	FAM_T(nat, key) k;
	__u64 stamp;
	int arm;

	FAM(inbound_key)(p, DIR_EGRESS, &k);
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (!v)
		return 0;
	/* answered, and still going 2 s after it started: a UDP stream, not
	 * dropped for a new flow (as a pair's), its note armed (evict.h) */
	arm = nat_udp_stream(k.proto, &v->flags, v->created_ns);
	/* The pod's first FIN or RST: noted again, as the remote's; its first
	 * answer otherwise: a TCP record may go no more, its note armed. */
	if ((p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) && !(v->flags & (NAT_F_FIN | NAT_F_RST)))
		FAM(nat_cand_note)(&k, v->created_ns);
	else if (k.proto == IPPROTO_TCP && !(p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) &&
		 !(v->flags & (NAT_F_SEEN | NAT_F_FIN | NAT_F_RST)))
		arm = 1;
	stamp = FAM(nat_touch)(v, (p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	if (arm && stamp != NAT_CLAIMED)
		FAM(nat_cand_mark)(&k, v->created_ns, stamp | NAT_NOTE_ARMED);
	return 1;
}

#undef FAMILY
#include "family.h"
