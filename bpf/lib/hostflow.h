/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The node's own flows: tuples held from NAT, and remapped clashes. */

#ifndef IPMASQ_LIB_HOSTFLOW_H
#define IPMASQ_LIB_HOSTFLOW_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "flow.h"

/*
 * A node socket may bind a port of the NAT range by itself (resolvers that
 * pick random ports do; the kernel's automatic choice avoids the range,
 * which the agent reserves). Like nf_nat_used_tuple, a node flow toward a
 * remote holds its reply tuple in the NAT map (a dir-1 entry marked
 * NAT_F_HOST, created by the flow's first packet), so no NAT pair takes
 * that port toward that remote, and its replies pass the ingress program
 * untouched. The entry lives by the flow's state, refreshed by its replies
 * (the ingress lookup happens anyway) and its first packets.
 *
 * Ports outside the range are not reserved: a pod keeps its own port there
 * only where no node socket holds the tuple (node_socket_v4), but the
 * node's kernel may choose that port later for a connection to the same
 * remote. Such a node flow gets a NAT pair of its own (a port of the range,
 * same address), as conntrack remaps a clashing tuple; its packets then
 * find their dir-0 entry like a pod's. Every node TCP/UDP packet costs one
 * lookup of that entry; only flow starts look further.
 */

/*
 * A source that stops being a masquerade source (a pod CIDR or a masquerade
 * rule removed) keeps its running flows translated until they end, as Linux
 * keeps a conntrack entry's NAT: its packets come here like the node's
 * (they are not a masquerade source's), find their dir-0 entry and are
 * translated by it; new flows of such a source are not masqueraded. This
 * costs the node's and other non-masquerade sources' TCP/UDP packets one
 * NAT lookup (the node's own paid it already).
 */

/* host_flow_* results. */
#define HOST_PASS	0	/* leaves untouched */
#define HOST_PAIR	1	/* has a NAT pair, or needs one: translated like a pod's flow */
#define HOST_FORMER	2	/* a former masquerade source's NAT pair: translated while it lasts, never made anew */

__noinline int host_flow_v4(struct __sk_buff *skb, struct pkt *p)
{
	struct nat_v4_key k = { .dir = DIR_EGRESS };
	struct nat_v4_val *v, nv = { .flags = NAT_F_HOST };
	struct masq_config *cfg = masq_cfg();
	int node, reuse = 0;
	__u16 port;
	__u64 now;

	if (!skb || !p || !cfg || p->frag == FRAG_LATER)
		return HOST_PASS;
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return HOST_PASS;
	node = bpf_map_lookup_elem(&node_addrs_v4, &p->v4.saddr) != NULL;
	if (parse_l4(skb, p, DIR_EGRESS) < 0)
		return HOST_PASS;
	k.src = p->v4.saddr;
	k.dst = p->v4.daddr;
	k.sport = p->sport;
	k.dport = p->dport;
	k.proto = p->proto;
	if (bpf_map_lookup_elem(&nat_v4, &k))
		/* given another port when it started, or a former masquerade
		 * source's flow */
		return node ? HOST_PAIR : HOST_FORMER;
	if (!node || !flow_start(p, DIR_EGRESS))
		return HOST_PASS;
	k.src = p->v4.daddr;
	k.dst = p->v4.saddr;
	k.sport = p->dport;
	k.dport = p->sport;
	k.dir = DIR_INGRESS;
	now = bpf_ktime_get_ns();
	port = bpf_ntohs(p->sport);
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (v) {
		if (v->flags & NAT_F_HOST) {
			nat_touch_v4(v, 0);
			return HOST_PASS;
		}
		/* A translated flow holds the tuple (a pod kept this port, which
		 * the node's kernel then chose too): the node's flow gets a port
		 * of the range, as conntrack remaps a clashing tuple. */
		reuse = nat_reusable_v4(&k, p->v4.saddr, now);
		if (!reuse)
			return HOST_PAIR;
	}
	if (port < cfg->port_min || port > cfg->port_max) {
		/* A pair that is over must not catch the node's replies
		 * (claimed: this CPU's to delete). */
		if (reuse == NAT_REUSE_CLAIMED)
			bpf_map_delete_elem(&nat_v4, &k);
		return HOST_PASS;
	}
	nv.addr = p->v4.saddr;
	nv.port = p->sport;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (bpf_map_update_elem(&nat_v4, &k, &nv, reuse == NAT_REUSE_CLAIMED ? BPF_ANY : BPF_NOEXIST) == 0)
		count(COUNTER_HOST_FLOW_NEW);
	else if (reuse == NAT_REUSE_CLAIMED)
		bpf_map_delete_elem(&nat_v4, &k); /* never left claimed */
	return HOST_PASS;
}

__noinline int host_flow_v6(struct __sk_buff *skb, struct pkt *p)
{
	struct nat_v6_key k = { .dir = DIR_EGRESS }, out;
	struct nat_v6_val *v, nv = { .flags = NAT_F_HOST };
	struct masq_config *cfg = masq_cfg();
	int node, reuse = 0;
	__u16 port;
	__u64 now;

	if (!skb || !p || !cfg || p->frag == FRAG_LATER)
		return HOST_PASS;
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return HOST_PASS;
	node = bpf_map_lookup_elem(&node_addrs_v6, p->v6.saddr) != NULL;
	if (parse_l4(skb, p, DIR_EGRESS) < 0)
		return HOST_PASS;
	__builtin_memcpy(k.src, p->v6.saddr, 16);
	__builtin_memcpy(k.dst, p->v6.daddr, 16);
	k.sport = p->sport;
	k.dport = p->dport;
	k.proto = p->proto;
	if (bpf_map_lookup_elem(&nat_v6, &k))
		return node ? HOST_PAIR : HOST_FORMER; /* see host_flow_v4 */
	if (!node || !flow_start(p, DIR_EGRESS))
		return HOST_PASS;
	out = k;
	__builtin_memcpy(k.src, p->v6.daddr, 16);
	__builtin_memcpy(k.dst, p->v6.saddr, 16);
	k.sport = p->dport;
	k.dport = p->sport;
	k.dir = DIR_INGRESS;
	now = bpf_ktime_get_ns();
	port = bpf_ntohs(p->sport);
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (v) {
		if (v->flags & NAT_F_HOST) {
			nat_touch_v6(v, 0);
			return HOST_PASS;
		}
		/* See host_flow_v4. */
		reuse = nat_reusable_v6(&k, &out, now);
		if (!reuse)
			return HOST_PAIR;
	}
	if (port < cfg->port_min || port > cfg->port_max) {
		if (reuse == NAT_REUSE_CLAIMED)
			bpf_map_delete_elem(&nat_v6, &k);
		return HOST_PASS;
	}
	__builtin_memcpy(nv.addr, p->v6.saddr, 16);
	nv.port = p->sport;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (bpf_map_update_elem(&nat_v6, &k, &nv, reuse == NAT_REUSE_CLAIMED ? BPF_ANY : BPF_NOEXIST) == 0)
		count(COUNTER_HOST_FLOW_NEW);
	else if (reuse == NAT_REUSE_CLAIMED)
		bpf_map_delete_elem(&nat_v6, &k); /* never left claimed */
	return HOST_PASS;
}

#endif /* IPMASQ_LIB_HOSTFLOW_H */
