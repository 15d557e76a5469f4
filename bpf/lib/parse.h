/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Parsing: the network and transport headers into struct pkt. */

#ifndef IPMASQ_LIB_PARSE_H
#define IPMASQ_LIB_PARSE_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <linux/icmpv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"

/* linux/icmp.h pulls in libc headers, so the few ICMPv4 constants live here. */
#define ICMP_ECHOREPLY		0
#define ICMP_DEST_UNREACH	3
#define ICMP_ECHO		8
#define ICMP_TIME_EXCEEDED	11
#define ICMP_PARAMETERPROB	12

#define IP_MF		0x2000
#define IP_OFFSET	0x1fff
#define IP6_MF		0x0001
#define IP6_OFFSET	0xfff8

/* Extension headers skipped before giving up on an IPv6 packet. */
#define IPV6_MAX_EXT	4

enum frag_kind {
	FRAG_NONE,
	FRAG_FIRST,	/* offset 0, more fragments follow: carries the L4 header */
	FRAG_LATER,	/* no L4 header */
};

enum pkt_kind {
	PKT_OTHER,	/* nothing to translate */
	PKT_PORTS,	/* TCP, UDP, ICMP echo request (egress) or reply (ingress) */
	PKT_ICMP_ERR,	/* ICMP error */
	PKT_ECHO_INBOUND, /* ICMP echo of an inbound flow: request (ingress) or reply (egress) */
	PKT_SCTP,	/* SCTP: ports, the NAT port is the pod's (see fixed.h) */
	PKT_ADDR,	/* any other protocol, other ICMP types: address-only (fixed.h) */
};

/* A parsed packet; addresses in network byte order. */
struct pkt {
	union {
		struct {
			__be32 saddr;
			__be32 daddr;
		} v4;
		struct {
			__u8 saddr[16];
			__u8 daddr[16];
		} v6;
	};
	__u32 l3_off;		/* network header: 0 on L3 devices, ETH_HLEN on Ethernet */
	__u32 l4_off;
	__be32 frag_id;
	__be16 sport;		/* ICMP echo request: the identifier */
	__be16 dport;		/* ICMP echo reply: the identifier */
	__u8 proto;
	__u8 kind;
	__u8 frag;
	__u8 tcp_flags;		/* NAT_F_* */
	__u32 tcp_end;		/* TCP: seq + payload length (+1 for SYN, FIN), host order */
};

static __always_inline int parse_l3_v4(struct __sk_buff *skb, struct pkt *p)
{
	struct iphdr ip;
	__u16 frag_off;

	if (bpf_skb_load_bytes(skb, p->l3_off, &ip, sizeof(ip)) < 0)
		return -1;
	if (ip.version != 4 || ip.ihl < 5)
		return -1;
	p->v4.saddr = ip.saddr;
	p->v4.daddr = ip.daddr;
	p->proto = ip.protocol;
	p->l4_off = p->l3_off + ip.ihl * 4;
	p->frag_id = ip.id;
	frag_off = bpf_ntohs(ip.frag_off);
	if (frag_off & IP_OFFSET)
		p->frag = FRAG_LATER;
	else if (frag_off & IP_MF)
		p->frag = FRAG_FIRST;
	else
		p->frag = FRAG_NONE;
	return 0;
}

/* parse_l3_v6 walks up to IPV6_MAX_EXT extension headers. It returns 1 for a
 * header chain it does not handle (too many headers, or one that runs past
 * the packet's end), -1 when the fixed header cannot be read: the addresses
 * are known from 0 on, so the egress path can drop an untranslatable
 * packet of a masquerade source rather than pass it. */
static __always_inline int parse_l3_v6(struct __sk_buff *skb, struct pkt *p)
{
	struct ipv6hdr ip;
	__u32 off = p->l3_off + sizeof(ip);
	__u8 nexthdr;

	if (bpf_skb_load_bytes(skb, p->l3_off, &ip, sizeof(ip)) < 0)
		return -1;
	if (ip.version != 6)
		return -1;
	__builtin_memcpy(p->v6.saddr, &ip.saddr, 16);
	__builtin_memcpy(p->v6.daddr, &ip.daddr, 16);
	p->frag = FRAG_NONE;
	p->frag_id = 0;
	nexthdr = ip.nexthdr;

#pragma unroll
	for (int i = 0; i < IPV6_MAX_EXT; i++) {
		struct {
			__u8 nexthdr;
			__u8 len;
			__be16 frag_off;
			__be32 id;
		} ext;

		switch (nexthdr) {
		case IPPROTO_HOPOPTS:
		case IPPROTO_ROUTING:
		case IPPROTO_DSTOPTS:
			if (bpf_skb_load_bytes(skb, off, &ext, 2) < 0)
				return 1;
			nexthdr = ext.nexthdr;
			off += (ext.len + 1) * 8;
			break;
		case IPPROTO_FRAGMENT:
			if (bpf_skb_load_bytes(skb, off, &ext, sizeof(ext)) < 0)
				return 1;
			nexthdr = ext.nexthdr;
			off += 8;
			p->frag_id = ext.id;
			if (bpf_ntohs(ext.frag_off) & IP6_OFFSET)
				p->frag = FRAG_LATER;
			else if (bpf_ntohs(ext.frag_off) & IP6_MF)
				p->frag = FRAG_FIRST;
			break;
		default:
			goto done;
		}
	}
	switch (nexthdr) {
	case IPPROTO_HOPOPTS:
	case IPPROTO_ROUTING:
	case IPPROTO_DSTOPTS:
	case IPPROTO_FRAGMENT:
		return 1;
	}
done:
	p->proto = nexthdr;
	p->l4_off = off;
	return 0;
}

static __always_inline int is_icmp_error_v4(__u8 type)
{
	return type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED ||
	       type == ICMP_PARAMETERPROB;
}

static __always_inline int is_icmp_error_v6(__u8 type)
{
	return type == ICMPV6_DEST_UNREACH || type == ICMPV6_PKT_TOOBIG ||
	       type == ICMPV6_TIME_EXCEED || type == ICMPV6_PARAMPROB;
}

/* parse_l4 fills ports, TCP flags and the packet kind. It must not be called
 * for non-first fragments. */
static __always_inline int parse_l4(struct __sk_buff *skb, struct pkt *p, int dir)
{
	struct {
		__be16 sport;
		__be16 dport;
		__u32 seq;
		__u32 ack;
		__u8 off;
		__u8 flags;
	} l4;
	__u8 echo_req = p->proto == IPPROTO_ICMP ? ICMP_ECHO : ICMPV6_ECHO_REQUEST;
	__u8 echo_rep = p->proto == IPPROTO_ICMP ? ICMP_ECHOREPLY : ICMPV6_ECHO_REPLY;
	struct {
		__u8 type;
		__u8 code;
		__be16 csum;
		__be16 id;
		__be16 seq;
	} *icmp = (void *)&l4;

	p->kind = PKT_OTHER;
	p->tcp_flags = 0;
	p->tcp_end = 0;
	p->sport = 0;
	p->dport = 0;
	switch (p->proto) {
	case IPPROTO_TCP:
		if (bpf_skb_load_bytes(skb, p->l4_off, &l4, sizeof(l4)) < 0)
			return -1;
		p->sport = l4.sport;
		p->dport = l4.dport;
		/* FIN 0x01, SYN 0x02, RST 0x04, ACK 0x10 */
		p->tcp_flags = (l4.flags & 0x01 ? NAT_F_FIN : 0) |
			       (l4.flags & 0x04 ? NAT_F_RST : 0) |
			       (l4.flags & 0x02 ? PKT_F_SYN : 0) |
			       (l4.flags & 0x10 ? PKT_F_ACK : 0);
		/* skb->len: a GSO packet's whole payload */
		p->tcp_end = bpf_ntohl(l4.seq) + (skb->len - p->l4_off - (__u32)(l4.off >> 4) * 4) +
			     !!(l4.flags & 0x03);
		p->kind = PKT_PORTS;
		break;
	case IPPROTO_UDP:
		if (bpf_skb_load_bytes(skb, p->l4_off, &l4, 8) < 0)
			return -1;
		p->sport = l4.sport;
		p->dport = l4.dport;
		p->kind = PKT_PORTS;
		break;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		if (bpf_skb_load_bytes(skb, p->l4_off, icmp, 8) < 0)
			return -1;
		if (p->proto == IPPROTO_ICMP ? is_icmp_error_v4(icmp->type)
					     : is_icmp_error_v6(icmp->type)) {
			p->kind = PKT_ICMP_ERR;
		} else if (dir == DIR_EGRESS && icmp->type == echo_req) {
			p->sport = icmp->id;
			p->dport = 0;
			p->kind = PKT_PORTS;
		} else if (dir == DIR_INGRESS && icmp->type == echo_rep) {
			p->sport = 0;
			p->dport = icmp->id;
			p->kind = PKT_PORTS;
		} else if ((dir == DIR_INGRESS && icmp->type == echo_req) ||
			   (dir == DIR_EGRESS && icmp->type == echo_rep)) {
			/* laid out so that the dir-2 key comes out like the
			 * ports': source side id, remote side 0 */
			p->sport = dir == DIR_EGRESS ? icmp->id : 0;
			p->dport = dir == DIR_EGRESS ? 0 : icmp->id;
			p->kind = PKT_ECHO_INBOUND;
		} else {
			/* other types (timestamps, ...): address-only */
			p->kind = PKT_ADDR;
		}
		break;
	case IPPROTO_SCTP:
		if (bpf_skb_load_bytes(skb, p->l4_off, &l4, 4) < 0)
			return -1;
		p->sport = l4.sport;
		p->dport = l4.dport;
		p->kind = PKT_SCTP;
		break;
	default:
		p->kind = PKT_ADDR;
		break;
	}
	return 0;
}

/* Offset of the L4 checksum from the start of the L4 header. */
static __always_inline __u32 l4_csum_off(__u8 proto)
{
	switch (proto) {
	case IPPROTO_TCP:
		return offsetof(struct tcphdr, check);
	case IPPROTO_UDP:
		return offsetof(struct udphdr, check);
	default: /* ICMP, ICMPv6 */
		return 2;
	}
}

/* Offset of the translated port from the start of the L4 header: the source
 * port on egress, the destination port on ingress, the echo identifier. */
static __always_inline __u32 l4_port_off(__u8 proto, int dir)
{
	if (proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6)
		return 4;
	return dir == DIR_EGRESS ? 0 : 2;
}

#endif /* IPMASQ_LIB_PARSE_H */
