/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* ICMP errors on ingress, and the quote rewriting both directions share. */

#ifndef IPMASQ_LIB_ICMP_H
#define IPMASQ_LIB_ICMP_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/icmpv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "rewrite.h"

/*
 * An ICMP error about a translated flow quotes the packet as we sent it
 * (src = SNAT address, sport = NAT port). The reply entry of that flow has
 * the quoted tuple reversed. Rewritten: the outer destination, the quoted
 * source address and port, the quoted IPv4 header checksum, the quoted L4
 * checksum when the quote includes it, and the ICMP checksum for every
 * changed payload field. The quoted address and quoted IPv4 checksum change
 * by opposite amounts, so they leave the ICMP checksum alone; the quoted L4
 * checksum does not (it also covers the unquoted rest of the segment), so
 * its change is applied to the ICMP checksum explicitly. Quoted checksums
 * are patched with bpf_l3_csum_replace, which edits a checksum field
 * regardless of skb->ip_summed.
 */

/* Inner L4 lookup shared by both families: the quoted ports (or echo id) as
 * the dir-1 key wants them. Returns -1 if the quote cannot be translated. */
static __always_inline int icmp_inner_ports(struct __sk_buff *skb, __u8 proto, __u32 off,
					    __be16 *sport, __be16 *dport, __u32 *port_off)
{
	struct {
		__be16 a;
		__be16 b;
		__be16 c;
	} h;

	if (bpf_skb_load_bytes(skb, off, &h, sizeof(h)) < 0 &&
	    (proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP ||
	     proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6))
		return -1;
	switch (proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		/* quoted sport is our NAT port: reversed it is the reply's dport */
		*sport = h.b;
		*dport = h.a;
		*port_off = off;
		return 0;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		/* only quoted echo requests have an identifier we allocated */
		if ((__u8)h.a != (proto == IPPROTO_ICMP ? ICMP_ECHO : ICMPV6_ECHO_REQUEST))
			return -1;
		*sport = 0;
		*dport = h.c;
		*port_off = off + 4;
		return 0;
	}
	/* address-only: no ports (the quote may be shorter than h: GRE, ESP
	 * quotes hold 8 bytes at least, as RFC 792 promises) */
	*sport = 0;
	*dport = 0;
	*port_off = 0;
	return 0;
}

/* icmp_inner_l4_csum returns the offset of the quoted L4 checksum, or 0 when
 * the quote is too short to hold it or it is a zero (absent) UDP checksum. */
static __always_inline __u32 icmp_inner_l4_csum(struct __sk_buff *skb, __u8 proto, __u32 off)
{
	__u32 csum_off = off + l4_csum_off(proto);
	__be16 csum;

	/* SCTP's CRC32c and GRE's checksum do not cover addresses or change */
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_ICMP &&
	    proto != IPPROTO_ICMPV6)
		return 0;
	if (csum_off + 2 > skb->len)
		return 0;
	if (bpf_skb_load_bytes(skb, csum_off, &csum, 2) < 0)
		return 0;
	if (proto == IPPROTO_UDP && csum == 0)
		return 0;
	return csum_off;
}

/* icmp_quote_port rewrites the quoted port (or echo id) and the quoted L4
 * checksum, and carries both changes into the outer ICMP checksum. addr_diff
 * is the change of the quoted address for the quoted pseudo header (0 for
 * ICMP quotes, which have none). port_off 0: an address-only quote, no
 * port. */
static __always_inline int icmp_quote_port(struct __sk_buff *skb, __u32 icmp_csum, __u8 proto,
					   __u32 l4_off, __u32 port_off, __be16 pfrom, __be16 pto,
					   __u32 addr_diff)
{
	__u32 csum_off = icmp_inner_l4_csum(skb, proto, l4_off);
	__be16 old_csum, new_csum;

	if (csum_off) {
		if (bpf_skb_load_bytes(skb, csum_off, &old_csum, 2) < 0)
			return -1;
		if (addr_diff &&
		    bpf_l3_csum_replace(skb, csum_off, 0, addr_diff, 0) < 0)
			return -1;
		if (port_off && bpf_l3_csum_replace(skb, csum_off, pfrom, pto, 2) < 0)
			return -1;
		if (bpf_skb_load_bytes(skb, csum_off, &new_csum, 2) < 0)
			return -1;
		if (proto == IPPROTO_UDP && new_csum == 0) {
			/* zero means "no checksum" for UDP */
			new_csum = 0xffff;
			if (bpf_skb_store_bytes(skb, csum_off, &new_csum, 2, 0) < 0)
				return -1;
		}
		if (bpf_l4_csum_replace(skb, icmp_csum, old_csum, new_csum, 2) < 0)
			return -1;
	}
	if (!port_off || pfrom == pto)
		return 0;
	if (bpf_l4_csum_replace(skb, icmp_csum, pfrom, pto, 2) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, port_off, &pto, 2, 0) < 0)
		return -1;
	return 0;
}

static __noinline int icmp_error_v4(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 inner_off = p->l4_off + 8, inner_l4, port_off, addr_diff = 0;
	__u32 icmp_csum = p->l4_off + 2;
	struct nat_v4_key k = { .dir = DIR_INGRESS };
	struct nat_v4_val *v;
	struct iphdr ip;
	__be32 from, to;
	__be16 pfrom;

	if (bpf_skb_load_bytes(skb, inner_off, &ip, sizeof(ip)) < 0)
		return TC_ACT_UNSPEC;
	if (ip.version != 4 || ip.ihl < 5 || ip.saddr != p->v4.daddr ||
	    (bpf_ntohs(ip.frag_off) & IP_OFFSET))
		return TC_ACT_UNSPEC;
	inner_l4 = inner_off + ip.ihl * 4;
	k.src = ip.daddr;
	k.dst = ip.saddr;
	k.proto = ip.protocol;
	if (icmp_inner_ports(skb, ip.protocol, inner_l4, &k.sport, &k.dport, &port_off) < 0)
		return TC_ACT_UNSPEC;
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (!v)
		return TC_ACT_UNSPEC;
	from = ip.saddr;
	to = v->addr;
	pfrom = k.dport;

	/* outer destination: the IPv4 header checksum only */
	if (bpf_l3_csum_replace(skb, p->l3_off + offsetof(struct iphdr, check), from, to, 4) < 0 ||
	    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct iphdr, daddr), &to, 4, 0) < 0)
		goto err;
	/* quoted source and quoted header checksum: net zero for the ICMP sum */
	if (bpf_l3_csum_replace(skb, inner_off + offsetof(struct iphdr, check), from, to, 4) < 0 ||
	    bpf_skb_store_bytes(skb, inner_off + offsetof(struct iphdr, saddr), &to, 4, 0) < 0)
		goto err;
	if (ip.protocol != IPPROTO_ICMP)
		addr_diff = bpf_csum_diff(&from, 4, &to, 4, 0);
	if (icmp_quote_port(skb, icmp_csum, ip.protocol, inner_l4, port_off, pfrom, v->port,
			    addr_diff) < 0)
		goto err;
	count(COUNTER_ICMP_ERR_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

static __noinline int icmp_error_v6(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 inner_off = p->l4_off + 8, inner_l4 = inner_off + sizeof(struct ipv6hdr), port_off;
	__u32 icmp_csum = p->l4_off + 2, diff;
	struct nat_v6_key k = { .dir = DIR_INGRESS };
	struct nat_v6_val *v;
	struct ipv6hdr ip;
	__u8 from[16], to[16];
	__be16 pfrom;

	if (bpf_skb_load_bytes(skb, inner_off, &ip, sizeof(ip)) < 0)
		return TC_ACT_UNSPEC;
	if (ip.version != 6 || !addr6_equal((const __u8 *)&ip.saddr, p->v6.daddr))
		return TC_ACT_UNSPEC;
	/* Quotes with extension headers are not translated. */
	__builtin_memcpy(k.src, &ip.daddr, 16);
	__builtin_memcpy(k.dst, &ip.saddr, 16);
	k.proto = ip.nexthdr;
	if (icmp_inner_ports(skb, ip.nexthdr, inner_l4, &k.sport, &k.dport, &port_off) < 0)
		return TC_ACT_UNSPEC;
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (!v)
		return TC_ACT_UNSPEC;
	__builtin_memcpy(from, &ip.saddr, 16);
	__builtin_memcpy(to, v->addr, 16);
	pfrom = k.dport;
	diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);

	/* outer destination: in the ICMPv6 pseudo header */
	if (bpf_l4_csum_replace(skb, icmp_csum, 0, diff, BPF_F_PSEUDO_HDR | csum_ipv6_flag) < 0 ||
	    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct ipv6hdr, daddr), to, 16, 0) < 0)
		goto err;
	/* quoted source: ICMPv6 payload */
	if (bpf_l4_csum_replace(skb, icmp_csum, 0, diff, 0) < 0 ||
	    bpf_skb_store_bytes(skb, inner_off + offsetof(struct ipv6hdr, saddr), to, 16, 0) < 0)
		goto err;
	/* ICMPv6 quotes have a pseudo header too */
	if (icmp_quote_port(skb, icmp_csum, ip.nexthdr, inner_l4, port_off, pfrom, v->port,
			    diff) < 0)
		goto err;
	count(COUNTER_ICMP_ERR_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

#endif /* IPMASQ_LIB_ICMP_H */
