/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The ingress path of ingress.h for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers
 * it uses.
 *
 * Defines: ingress_v4, ingress_v6.
 */

#include "family.h"

static __always_inline int FAM(ingress)(struct __sk_buff *skb, __u32 l3_off)
{
	FAM_T(nat, key) k = { .dir = DIR_INGRESS };
	FAM_T(nat, val) *v;
	FAM_ADDR from, to;
	struct pkt p;
	__u64 stamp;
	__be16 port;
	int arm;

	p.l3_off = l3_off;
	/* IPv6: 1 is a header chain the parser does not walk, left alone */
	if (FAM(parse_l3)(skb, &p) != 0)
		return TC_ACT_UNSPEC;
	if (p.frag == FRAG_LATER)
		return FAM(ingress_frag)(skb, &p);
	if (parse_l4(skb, &p, DIR_INGRESS) < 0)
		return TC_ACT_UNSPEC;
	if (p.kind == PKT_ICMP_ERR)
		return FAM(icmp_error)(skb, &p);
	if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
		return FAM(ingress_fixed)(skb, &p);
	if (p.kind == PKT_ECHO_INBOUND)
		return FAM(inbound_track)(skb, &p);
	if (p.kind != PKT_PORTS)
		return TC_ACT_UNSPEC;

	FAM_ADDR_COPY(k.src, FAM_PKT(&p).saddr);
	FAM_ADDR_COPY(k.dst, FAM_PKT(&p).daddr);
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	v = bpf_map_lookup_elem(&FAM(nat), &k);
	if (!v)
		return FAM(inbound_track)(skb, &p);
	arm = nat_udp_stream(p.proto, &v->flags, v->created_ns);
	/* The remote's first FIN: does it acknowledge the source's? */
	if ((p.tcp_flags & NAT_F_FIN) && !(v->flags & (NAT_F_FIN | NAT_F_HOST)))
		FAM(nat_reply_fin)(skb, &k, v, &p);
	if (p.proto == IPPROTO_TCP && !(v->flags & NAT_F_HOST)) {
		/* An established pair ends by a RST the pod expects only (see
		 * "RSTs" in flow.h); what the remote sent is recorded. */
		/* A new connection on the tuple? Not asked of a SYN-ACK whose
		 * end is the one recorded (sent again): nat_reply_syn would
		 * record it again, and its lookup and read of the ACK are most
		 * of a reply's cost. */
		if ((p.tcp_flags & (PKT_F_SYN | NAT_F_RST)) == PKT_F_SYN && (v->flags & NAT_F_SEEN) &&
		    p.tcp_end != v->tcp_end)
			FAM(nat_reply_syn)(skb, &k, v, &p);
		if (!(p.tcp_flags & NAT_F_RST))
			tcp_seen(&v->tcp_end, &p, 1);
		else if ((v->flags & (NAT_F_SEEN | NAT_F_RST)) == NAT_F_SEEN && !FAM(nat_reply_rst)(&k, v, &p))
			p.tcp_flags &= ~NAT_F_RST;
	}
	/* The remote's first FIN or RST (one the pod expects): the pair may go
	 * for a new flow again (pressure.h), noted for early drop (evict.h).
	 * Its first answer otherwise: a TCP pair may go no more, its note
	 * armed (as a UDP pair's that became a stream). */
	if ((p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) && !(v->flags & (NAT_F_FIN | NAT_F_RST | NAT_F_HOST)))
		FAM(nat_cand_note)(&k, v->created_ns);
	else if (p.proto == IPPROTO_TCP && !(p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) &&
		 !(v->flags & (NAT_F_SEEN | NAT_F_FIN | NAT_F_RST)))
		arm = 1;
	stamp = FAM(nat_touch)(v, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	if (v->flags & NAT_F_HOST)
		return TC_ACT_UNSPEC; /* a node flow's reply */
	if (arm && stamp != NAT_CLAIMED)
		FAM(nat_cand_mark)(&k, v->created_ns, stamp | NAT_NOTE_ARMED);
	/* A flow handed to (or adopted from) conntrack: its replies are
	 * conntrack's to translate while it has the flow (handover.h). A
	 * TCP segment of the flow being handed back, before conntrack has
	 * its translating entry, is dropped (the remote sends it again):
	 * translated here, it could make conntrack an entry of its own that
	 * the agent's entry then clashes with. */
	if (v->handover == NAT_HANDOVER_CONNTRACK) {
		if (FAM(conntrack_holds)(skb, &p))
			return TC_ACT_UNSPEC;
		if (handback_on() && FAM(handback_window)(&p)) {
			count(COUNTER_DROP_HANDBACK);
			return TC_ACT_SHOT;
		}
	}
	FAM_ADDR_COPY(from, FAM_PKT(&p).daddr);
	FAM_ADDR_COPY(to, v->addr);
	port = v->port;
	/* A pair being ended (its answer came after early drop or the
	 * collector claimed it: it is not marked answered), or an entry
	 * reused by another pair meanwhile: never sent to the pod it names. */
	if (!FAM(nat_still)(&k, v, stamp)) {
		count(COUNTER_DROP_PAIR_CLAIMED);
		return TC_ACT_SHOT;
	}
	if (p.frag == FRAG_FIRST)
		FAM(frag_remember)(&p, DIR_INGRESS, to);
	if (FAM_REWRITE(skb, &p, daddr, from, to, p.proto, p.l4_off + l4_csum_off(p.proto),
			p.l4_off + l4_port_off(p.proto, DIR_INGRESS), p.dport, port) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_REVERSE);
	return TC_ACT_UNSPEC;
}

#undef FAMILY
#include "family.h"
