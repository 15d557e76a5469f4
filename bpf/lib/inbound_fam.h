/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The inbound flows of inbound.h for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
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

/* inbound_track_v4/v6 record (or refresh, or reopen) the inbound flow of an
 * ingress packet that matched no NAT pair. Mid-stream TCP segments cost
 * nothing: only SYN, FIN and RST are looked at. */
static __always_inline void FAM(inbound_track)(struct __sk_buff *skb, const struct pkt *p)
{
	const struct masq_rule *rule;
	FAM_T(nat, val) *v, nv = {};
	struct masq_config *cfg;
	FAM_T(nat, key) k;
	__u64 now;

	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & (PKT_F_SYN | NAT_F_FIN | NAT_F_RST)))
		return;
	if (!FAM(masq_source)(skb, FAM_PKT(p).daddr, &rule))
		return;
	FAM(inbound_key)(p, DIR_INGRESS, &k);
	now = bpf_ktime_get_ns();
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (v) {
		cfg = masq_cfg();
		if (p->proto == IPPROTO_TCP && flow_start(p, DIR_INGRESS) && cfg &&
		    (v->flags & (NAT_F_FIN | NAT_F_RST) ||
		     nat_expired(cfg, k.proto, v->flags, v->last_seen_ns, now))) {
			NAT_RESET(v, now);
			return;
		}
		FAM(nat_touch)(v, p->tcp_flags & (NAT_F_FIN | NAT_F_RST));
		return;
	}
	if (!flow_start(p, DIR_INGRESS))
		return;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (FAM(nat_insert)(&k, &nv) == 0)
		count(COUNTER_INBOUND_NEW);
}

/* inbound_reply_v4/v6 say whether an egress packet without a NAT pair
 * answers a recorded inbound flow (and refresh the record). */
static __always_inline int FAM(inbound_reply)(const struct pkt *p)
{
	FAM_T(nat, val) *v;
	FAM_T(nat, key) k;

	FAM(inbound_key)(p, DIR_EGRESS, &k);
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (!v)
		return 0;
	FAM(nat_touch)(v, (p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	return 1;
}

#undef FAMILY
#include "family.h"
