/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The node's own flows of hostflow.h for one family: a template, included
 * once with FAMILY 4 and once with FAMILY 6 (see family.h), after the
 * headers it uses.
 *
 * Defines: host_flow_v4, host_flow_v6.
 */

#include "family.h"

/* host_flow_v4/v6 sort a TCP/UDP packet that is not a masquerade source's:
 * HOST_PASS, HOST_PAIR or HOST_FORMER (see hostflow.h); a later fragment
 * is HOST_PASS here (egress.h hands it to egress_frag_other_*). A node
 * flow's first packet makes its held tuple here. */
GLOBAL_FUNC int FAM(host_flow)(struct __sk_buff *skb, struct pkt *p)
{
	FAM_T(nat, key) k = { .dir = DIR_EGRESS }, out;
	FAM_T(nat, val) *v, nv = { .flags = NAT_F_HOST };
	struct masq_config *cfg = masq_cfg();
	int node, reuse = 0;
	__u16 port;
	__u64 now;

	if (!skb || !p || !cfg)
		return HOST_PASS;
	/* Later fragments are egress_frag_other's (egress.h), not a flow's. */
	if (p->frag == FRAG_LATER)
		return HOST_PASS;
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return HOST_PASS;
	if (parse_l4(skb, p, DIR_EGRESS) < 0)
		return HOST_PASS;
	FAM_ADDR_COPY(k.src, FAM_PKT(p).saddr);
	FAM_ADDR_COPY(k.dst, FAM_PKT(p).daddr);
	k.sport = p->sport;
	k.dport = p->dport;
	k.proto = p->proto;
	/* The source as copied to the stack: a global function's pointer
	 * argument is no map key before 6.2 (lib/compat.h: "Keys"). */
	node = bpf_map_lookup_elem(&FAM(node_addrs), FAM_PTR(k.src)) != NULL;
	if (bpf_map_lookup_elem(&FAM(nat), &k))
		/* given another port when it started, or a former masquerade
		 * source's flow */
		return node ? HOST_PAIR : HOST_FORMER;
	if (!node || !flow_start(p, DIR_EGRESS))
		return HOST_PASS;
	out = k;
	FAM_ADDR_COPY(k.src, FAM_PKT(p).daddr);
	FAM_ADDR_COPY(k.dst, FAM_PKT(p).saddr);
	k.sport = p->dport;
	k.dport = p->sport;
	k.dir = DIR_INGRESS;
	now = bpf_ktime_get_ns();
	port = bpf_ntohs(p->sport);
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (v) {
		if (v->flags & NAT_F_HOST) {
			FAM(nat_touch)(v, 0);
			return HOST_PASS;
		}
		/* conntrack translated this datagram to a pair's tuple it
		 * holds (handover.h): it is the pod's flow, not the node's. */
		if (v->handover == NAT_HANDOVER_CONNTRACK)
			return HOST_PASS;
		/* A translated flow holds the tuple (a pod kept this port, which
		 * the node's kernel then chose too): the node's flow gets a port
		 * of the range, as conntrack remaps a clashing tuple. */
#if FAM_IS_V6
		reuse = nat_reusable_v6(&k, &out, now); /* the flow's key; v4 its source */
#else
		reuse = nat_reusable_v4(&k, out.src, now);
#endif
		if (!reuse)
			return HOST_PAIR;
	}
	if (!nat_port_in_range(cfg, port)) {
		/* A pair that is over must not catch the node's replies
		 * (claimed: this CPU's to delete). */
		if (reuse == NAT_REUSE_CLAIMED)
			FAM(nat_delete)(&k);
		return HOST_PASS;
	}
	FAM_ADDR_COPY(nv.addr, FAM_PKT(p).saddr);
	nv.port = p->sport;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if ((reuse == NAT_REUSE_CLAIMED ? FAM(nat_replace)(&k, &nv) : FAM(nat_insert)(&k, &nv)) == 0)
		count(COUNTER_HOST_FLOW_NEW);
	else if (reuse == NAT_REUSE_CLAIMED)
		FAM(nat_delete)(&k); /* never left claimed */
	return HOST_PASS;
}

#undef FAMILY
#include "family.h"
