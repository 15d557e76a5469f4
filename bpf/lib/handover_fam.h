/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The handover of handover.h for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers
 * it uses.
 *
 * Defines: ct_find_v4, ct_find_v6, conntrack_holds_v4, conntrack_holds_v6,
 * handback_stray_v4, handback_stray_v6, handback_window_v4,
 * handback_window_v6, nat_handover_run_v4,
 * nat_handover_run_v6.
 */

#include "family.h"

/* ct_find_v4/v6 is conntrack's entry whose tuple in either direction is
 * saddr:sport -> daddr:dport (addresses in network order, 4 or 16 bytes),
 * or NULL; the caller releases it. */
static __always_inline struct nf_conn *FAM(ct_find)(struct __sk_buff *skb, __u8 proto, const void *saddr,
						    const void *daddr, __be16 sport, __be16 dport)
{
	struct bpf_ct_opts___ipmasq opts = { .netns_id = CT_NETNS_CURRENT, .l4proto = proto };
	struct bpf_sock_tuple t = {};

#if FAM_IS_V6
	__builtin_memcpy(t.ipv6.saddr, saddr, 16);
	__builtin_memcpy(t.ipv6.daddr, daddr, 16);
	t.ipv6.sport = sport;
	t.ipv6.dport = dport;
	return bpf_skb_ct_lookup(skb, &t, sizeof(t.ipv6), &opts, CT_OPTS_SZ);
#else
	__builtin_memcpy(&t.ipv4.saddr, saddr, 4);
	__builtin_memcpy(&t.ipv4.daddr, daddr, 4);
	t.ipv4.sport = sport;
	t.ipv4.dport = dport;
	return bpf_skb_ct_lookup(skb, &t, sizeof(t.ipv4), &opts, CT_OPTS_SZ);
#endif
}

/* conntrack_holds_v4/v6 says whether conntrack has an entry for p's tuple
 * as it arrived (a reply it will translate itself). */
static __noinline int FAM(conntrack_holds)(struct __sk_buff *skb, const struct pkt *p)
{
	struct nf_conn *ct;

	if (!skb || !p || !conntrack_lookup)
		return 0;
	ct = FAM(ct_find)(skb, p->proto, FAM_PTR(FAM_PKT(p).saddr), FAM_PTR(FAM_PKT(p).daddr), p->sport, p->dport);
	if (!ct)
		return 0;
	bpf_ct_release(ct);
	return 1;
}

/* handback_stray_v4/v6 says whether p, a packet from the node's address
 * that is no flow of the node's own, is a TCP segment of a flow being
 * handed back (handback_v4/v6) that conntrack translated to another port
 * than the pair's (handover.h, "The hand-back's races"): its conntrack
 * entry, found by its reply tuple, is the one of the flow's own tuple.
 * Called only while a hand-back is under way (handback_on). */
static __noinline int FAM(handback_stray)(struct __sk_buff *skb, const struct pkt *p)
{
	FAM_T(handback, key) hk = { .proto = IPPROTO_TCP };
	FAM_T(handback, val) *hv;
	struct nf_conn *seg, *flow;
	int stray;

	if (!skb || !p || p->proto != IPPROTO_TCP || p->frag != FRAG_NONE || p->kind != PKT_PORTS)
		return 0;
	FAM_ADDR_COPY(hk.remote, FAM_PKT(p).daddr);
	hk.rport = p->dport;
	hv = bpf_map_lookup_elem(&FAM(handback), &hk);
	if (!hv || hv->port == p->sport)
		return 0;
	seg = FAM(ct_find)(skb, IPPROTO_TCP, FAM_PTR(FAM_PKT(p).daddr), FAM_PTR(FAM_PKT(p).saddr), p->dport, p->sport);
	if (!seg)
		return 0;
	flow = FAM(ct_find)(skb, IPPROTO_TCP, FAM_PTR(hv->src), FAM_PTR(FAM_PKT(p).daddr), hv->sport, p->dport);
	stray = flow == seg;
	if (flow)
		bpf_ct_release(flow);
	bpf_ct_release(seg);
	return stray;
}

/* handback_window_v4/v6 says whether p, a TCP reply to a pair marked
 * conntrack's that conntrack does not hold (yet), is of the flow the agent
 * is handing back this instant (handback_v4/v6 names its remote and its
 * pair's port): between the agent's delete of conntrack's untranslated
 * entry and its create of the translating one (handover.h, "The
 * hand-back's races"). Called only while a hand-back is under way
 * (handback_on). */
static __noinline int FAM(handback_window)(const struct pkt *p)
{
	FAM_T(handback, key) hk = { .proto = IPPROTO_TCP };
	FAM_T(handback, val) *hv;

	if (!p || p->proto != IPPROTO_TCP || p->kind != PKT_PORTS)
		return 0;
	FAM_ADDR_COPY(hk.remote, FAM_PKT(p).saddr);
	hk.rport = p->sport;
	hv = bpf_map_lookup_elem(&FAM(handback), &hk);
	return hv && hv->port == p->dport;
}

/* nat_handover_run_v4/v6 runs one handover operation (handover.h). */
static __always_inline __u32 FAM(nat_handover_run)(const FAM_T(nat_handover, ctx) *ctx)
{
	FAM_T(nat, key) k, peer;
	FAM_T(nat, val) out = {}, back = {}, *v, *r;
	__u64 now = bpf_ktime_get_ns();

	__builtin_memcpy(&k, &ctx->key, sizeof(k));
	k.dir = DIR_EGRESS;
	if (ctx->op == NAT_HANDOVER_MARK) {
		v = bpf_map_lookup_elem(&FAM(nat), &k);
		if (!v)
			return NAT_HANDOVER_GONE;
		FAM(nat_pair)(&k, v, &peer);
		r = bpf_map_lookup_elem(&FAM(nat), &peer);
		/* the reply entry only if it points back at k */
		if (!r || !FAM_ADDR_EQ(r->addr, k.src) || r->port != k.sport)
			return NAT_HANDOVER_GONE;
		r->handover = NAT_HANDOVER_CONNTRACK;
		return NAT_HANDOVER_DONE;
	}
	if (bpf_map_lookup_elem(&FAM(nat), &k))
		return NAT_HANDOVER_EXISTS;
	FAM_ADDR_COPY(out.addr, ctx->addr);
	out.port = ctx->port;
	out.last_seen_ns = now;
	out.created_ns = now;
	FAM(nat_pair)(&k, &out, &peer);
	FAM_ADDR_COPY(back.addr, k.src);
	back.port = k.sport;
	back.flags = ctx->seen ? NAT_F_SEEN : 0;
	back.handover = NAT_HANDOVER_CONNTRACK;
	back.last_seen_ns = now;
	back.created_ns = now;
	/* The reply entry first, as the programs make a pair: it holds the
	 * port toward the remote. conntrack translates this flow to that
	 * tuple already, so the flow's replies come to it whoever else holds
	 * it here: a node flow's held tuple (NAT_F_HOST: the flow's first
	 * packet, translated by conntrack, reached the egress program with
	 * the node's address and looked like the node's own, hostflow.h), or
	 * an older pair conntrack did not know of (it chose the tuple
	 * because no entry of its own held it). That holder is claimed and
	 * replaced, and an older pair's egress entry goes with it, so that it
	 * no longer sends from the tuple. */
	r = bpf_map_lookup_elem(&FAM(nat), &peer);
	if (r) {
		__u64 seen = nat_stamp(&r->last_seen_ns);
		FAM_T(nat, key) old = { .proto = k.proto, .dir = DIR_EGRESS };

		if (!nat_claim(&r->last_seen_ns, seen, NAT_CLAIMED))
			return NAT_HANDOVER_TAKEN;
		if (!(r->flags & NAT_F_HOST)) {
			FAM_ADDR_COPY(old.src, r->addr);
			FAM_ADDR_COPY(old.dst, k.dst);
			old.sport = r->port;
			old.dport = k.dport;
			FAM(nat_delete)(&old);
		}
		if (FAM(nat_replace)(&peer, &back) != 0) {
			FAM(nat_delete)(&peer); /* never left claimed */
			return NAT_HANDOVER_FULL;
		}
	} else if (FAM(nat_insert)(&peer, &back) != 0) {
		return bpf_map_lookup_elem(&FAM(nat), &peer) ? NAT_HANDOVER_TAKEN : NAT_HANDOVER_FULL;
	}
	if (FAM(nat_insert)(&k, &out) != 0) {
		FAM(nat_delete)(&peer);
		return bpf_map_lookup_elem(&FAM(nat), &k) ? NAT_HANDOVER_EXISTS : NAT_HANDOVER_FULL;
	}
	return NAT_HANDOVER_DONE;
}

#undef FAMILY
#include "family.h"
