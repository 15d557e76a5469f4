/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Inbound flows: flows a remote opened toward a masquerade source. */

#ifndef IPMASQ_LIB_INBOUND_H
#define IPMASQ_LIB_INBOUND_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "decision.h"
#include "flow.h"

/*
 * A flow a remote opens toward a masquerade source (a pod reachable by
 * routing: BGP, a load balancer with IP targets) must be answered from the
 * pod's own address: Linux never translates the replies of a connection it
 * did not masquerade. The ingress program records such a flow (dir 2, keyed
 * by the pod's reply tuple) when its first packet arrives; on egress, a
 * packet without a NAT pair that matches a record passes untranslated.
 */

static __always_inline void inbound_key_v4(const struct pkt *p, int dir, struct nat_v4_key *k)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->proto = p->proto;
	k->dir = DIR_INBOUND;
	if (dir == DIR_EGRESS) {
		k->src = p->v4.saddr;
		k->dst = p->v4.daddr;
		k->sport = p->sport;
		k->dport = p->dport;
	} else {
		k->src = p->v4.daddr;
		k->dst = p->v4.saddr;
		k->sport = p->dport;
		k->dport = p->sport;
	}
}

static __always_inline void inbound_key_v6(const struct pkt *p, int dir, struct nat_v6_key *k)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->proto = p->proto;
	k->dir = DIR_INBOUND;
	if (dir == DIR_EGRESS) {
		__builtin_memcpy(k->src, p->v6.saddr, 16);
		__builtin_memcpy(k->dst, p->v6.daddr, 16);
		k->sport = p->sport;
		k->dport = p->dport;
	} else {
		__builtin_memcpy(k->src, p->v6.daddr, 16);
		__builtin_memcpy(k->dst, p->v6.saddr, 16);
		k->sport = p->dport;
		k->dport = p->sport;
	}
}

/* inbound_track_v4 records (or refreshes, or reopens) the inbound flow of an
 * ingress packet that matched no NAT pair. Mid-stream TCP segments cost
 * nothing: only SYN, FIN and RST are looked at. */
static __always_inline void inbound_track_v4(struct __sk_buff *skb, const struct pkt *p)
{
	const struct masq_rule *rule;
	struct nat_v4_val *v, nv = {};
	struct masq_config *cfg;
	struct nat_v4_key k;
	__u64 now;

	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & (PKT_F_SYN | NAT_F_FIN | NAT_F_RST)))
		return;
	if (!masq_source_v4(skb, p->v4.daddr, &rule))
		return;
	inbound_key_v4(p, DIR_INGRESS, &k);
	now = bpf_ktime_get_ns();
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (v) {
		cfg = masq_cfg();
		if (p->proto == IPPROTO_TCP && flow_start(p, DIR_INGRESS) && cfg &&
		    (v->flags & (NAT_F_FIN | NAT_F_RST) ||
		     nat_expired(cfg, k.proto, v->flags, v->last_seen_ns, now))) {
			NAT_RESET(v, now);
			return;
		}
		nat_touch_v4(v, p->tcp_flags & (NAT_F_FIN | NAT_F_RST));
		return;
	}
	if (!flow_start(p, DIR_INGRESS))
		return;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (bpf_map_update_elem(&nat_v4, &k, &nv, BPF_NOEXIST) == 0)
		count(COUNTER_INBOUND_NEW);
}

static __always_inline void inbound_track_v6(struct __sk_buff *skb, const struct pkt *p)
{
	const struct masq_rule *rule;
	struct nat_v6_val *v, nv = {};
	struct masq_config *cfg;
	struct nat_v6_key k;
	__u64 now;

	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & (PKT_F_SYN | NAT_F_FIN | NAT_F_RST)))
		return;
	if (!masq_source_v6(skb, p->v6.daddr, &rule))
		return;
	inbound_key_v6(p, DIR_INGRESS, &k);
	now = bpf_ktime_get_ns();
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (v) {
		cfg = masq_cfg();
		if (p->proto == IPPROTO_TCP && flow_start(p, DIR_INGRESS) && cfg &&
		    (v->flags & (NAT_F_FIN | NAT_F_RST) ||
		     nat_expired(cfg, k.proto, v->flags, v->last_seen_ns, now))) {
			NAT_RESET(v, now);
			return;
		}
		nat_touch_v6(v, p->tcp_flags & (NAT_F_FIN | NAT_F_RST));
		return;
	}
	if (!flow_start(p, DIR_INGRESS))
		return;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (bpf_map_update_elem(&nat_v6, &k, &nv, BPF_NOEXIST) == 0)
		count(COUNTER_INBOUND_NEW);
}

/* inbound_reply_v4 says whether an egress packet without a NAT pair answers
 * a recorded inbound flow (and refreshes the record). */
static __always_inline int inbound_reply_v4(const struct pkt *p)
{
	struct nat_v4_val *v;
	struct nat_v4_key k;

	inbound_key_v4(p, DIR_EGRESS, &k);
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (!v)
		return 0;
	nat_touch_v4(v, (p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	return 1;
}

static __always_inline int inbound_reply_v6(const struct pkt *p)
{
	struct nat_v6_val *v;
	struct nat_v6_key k;

	inbound_key_v6(p, DIR_EGRESS, &k);
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (!v)
		return 0;
	nat_touch_v6(v, (p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	return 1;
}

/* egress_no_pair results: what happens to an egress packet without a NAT
 * pair. */
#define NO_PAIR_PASS	0	/* leaves untranslated (counted here) */
#define NO_PAIR_CREATE	1	/* starts a flow: decide, and make a pair */
#define NO_PAIR_PICKUP	2	/* a masquerade source's mid-stream TCP segment: decide, and make a pair */
#define NO_PAIR_ORPHAN	3	/* a masquerade source's RST or SYN-ACK: decide; dropped if masqueraded */

/* egress_no_pair sorts an egress packet that has no NAT pair. A reply of an
 * inbound flow passes untranslated. A flow's first packet gets a pair. A
 * masquerade source's mid-stream TCP segment (its pair evicted, lost to a
 * race, or never made: a node migrated from iptables with open flows) is
 * picked up as Linux does with nf_conntrack_tcp_loose=1: it gets a pair,
 * its own port when free, and the connection carries on. A RST or SYN-ACK
 * starts nothing (Linux finds them INVALID and sends them untranslated):
 * here they are dropped when masqueraded, never sent with the source's
 * address. The node's own packets start pairs only as flows (a remap). */
static __always_inline int egress_no_pair(const struct pkt *p, int is_v6, int node)
{
	if (is_v6 ? inbound_reply_v6(p) : inbound_reply_v4(p)) {
		count(COUNTER_SKIP_INBOUND_REPLY);
		return NO_PAIR_PASS;
	}
	if (flow_start(p, DIR_EGRESS))
		return NO_PAIR_CREATE;
	if (node) {
		count(COUNTER_SKIP_NOT_FLOW_START);
		return NO_PAIR_PASS;
	}
	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & (NAT_F_RST | PKT_F_SYN)))
		return NO_PAIR_PICKUP;
	return NO_PAIR_ORPHAN;
}

#endif /* IPMASQ_LIB_INBOUND_H */
