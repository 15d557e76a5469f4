/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The ingress path: replies and ICMP errors of translated flows. */

#ifndef IPMASQ_LIB_INGRESS_H
#define IPMASQ_LIB_INGRESS_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "flow.h"
#include "inbound.h"
#include "rewrite.h"
#include "frag.h"
#include "icmp.h"
#include "fixed.h"

/* Misses are not counted on ingress: most packets are the host's own. */

static __always_inline int ingress_v4(struct __sk_buff *skb, __u32 l3_off)
{
	struct nat_v4_key k = { .dir = DIR_INGRESS };
	struct frag_v4_val *f;
	struct nat_v4_val *v;
	__be32 to;
	struct pkt p;

	p.l3_off = l3_off;
	if (parse_l3_v4(skb, &p) < 0)
		return TC_ACT_UNSPEC;
	if (p.frag == FRAG_LATER) {
		f = frag_lookup_v4(&p, DIR_INGRESS);
		if (!f)
			return TC_ACT_UNSPEC;
		if (rewrite_v4(skb, p.l3_off, p.l3_off + offsetof(struct iphdr, daddr), p.v4.daddr, f->addr,
			       p.proto, 0, 0, 0, 0) < 0)
			goto err;
		count(COUNTER_FRAGMENTS);
		return TC_ACT_UNSPEC;
	}
	if (parse_l4(skb, &p, DIR_INGRESS) < 0)
		return TC_ACT_UNSPEC;
	if (p.kind == PKT_ICMP_ERR)
		return icmp_error_v4(skb, &p);
	if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
		return ingress_fixed_v4(skb, &p);
	if (p.kind == PKT_ECHO_INBOUND) {
		inbound_track_v4(skb, &p);
		return TC_ACT_UNSPEC;
	}
	if (p.kind != PKT_PORTS)
		return TC_ACT_UNSPEC;

	k.src = p.v4.saddr;
	k.dst = p.v4.daddr;
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (!v) {
		inbound_track_v4(skb, &p);
		return TC_ACT_UNSPEC;
	}
	nat_udp_stream(p.proto, &v->flags, v->created_ns);
	nat_touch_v4(v, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	if (v->flags & NAT_F_HOST)
		return TC_ACT_UNSPEC; /* a node flow's reply */
	to = v->addr;
	if (p.frag == FRAG_FIRST)
		frag_remember_v4(&p, DIR_INGRESS, to);
	if (rewrite_v4(skb, p.l3_off, p.l3_off + offsetof(struct iphdr, daddr), p.v4.daddr, to,
		       p.proto, p.l4_off + l4_csum_off(p.proto),
		       p.l4_off + l4_port_off(p.proto, DIR_INGRESS), p.dport, v->port) < 0)
		goto err;
	count(COUNTER_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

static __always_inline int ingress_v6(struct __sk_buff *skb, __u32 l3_off)
{
	struct nat_v6_key k = { .dir = DIR_INGRESS };
	struct frag_v6_val *f;
	struct nat_v6_val *v;
	__u8 from[16], to[16];
	struct pkt p;

	p.l3_off = l3_off;
	if (parse_l3_v6(skb, &p) != 0)
		return TC_ACT_UNSPEC;
	__builtin_memcpy(from, p.v6.daddr, 16);
	if (p.frag == FRAG_LATER) {
		f = frag_lookup_v6(&p, DIR_INGRESS);
		if (!f)
			return TC_ACT_UNSPEC;
		__builtin_memcpy(to, f->addr, 16);
		if (rewrite_v6(skb, p.l3_off + offsetof(struct ipv6hdr, daddr), from, to,
			       p.proto, 0, 0, 0, 0) < 0)
			goto err;
		count(COUNTER_FRAGMENTS);
		return TC_ACT_UNSPEC;
	}
	if (parse_l4(skb, &p, DIR_INGRESS) < 0)
		return TC_ACT_UNSPEC;
	if (p.kind == PKT_ICMP_ERR)
		return icmp_error_v6(skb, &p);
	if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
		return ingress_fixed_v6(skb, &p);
	if (p.kind == PKT_ECHO_INBOUND) {
		inbound_track_v6(skb, &p);
		return TC_ACT_UNSPEC;
	}
	if (p.kind != PKT_PORTS)
		return TC_ACT_UNSPEC;

	__builtin_memcpy(k.src, p.v6.saddr, 16);
	__builtin_memcpy(k.dst, p.v6.daddr, 16);
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (!v) {
		inbound_track_v6(skb, &p);
		return TC_ACT_UNSPEC;
	}
	nat_udp_stream(p.proto, &v->flags, v->created_ns);
	nat_touch_v6(v, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	if (v->flags & NAT_F_HOST)
		return TC_ACT_UNSPEC; /* a node flow's reply */
	__builtin_memcpy(to, v->addr, 16);
	if (p.frag == FRAG_FIRST)
		frag_remember_v6(&p, DIR_INGRESS, to);
	if (rewrite_v6(skb, p.l3_off + offsetof(struct ipv6hdr, daddr), from, to,
		       p.proto, p.l4_off + l4_csum_off(p.proto),
		       p.l4_off + l4_port_off(p.proto, DIR_INGRESS), p.dport, v->port) < 0)
		goto err;
	count(COUNTER_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

static __always_inline int ingress(struct __sk_buff *skb, __u32 l3_off)
{
	switch (skb->protocol) {
	case bpf_htons(ETH_P_IP):
		return ingress_v4(skb, l3_off);
	case bpf_htons(ETH_P_IPV6):
		return ingress_v6(skb, l3_off);
	}
	return TC_ACT_UNSPEC;
}

#endif /* IPMASQ_LIB_INGRESS_H */
