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

/*
 * What differs between the families' ICMP errors, for the templates (here
 * and in icmp_egress.h): reading the quoted network header, and carrying a
 * change of a quoted address into the ICMP checksum.
 */

/* The family's ICMP protocol, and the offset of a field of the network
 * header at off: for a template (FAM_IS_V6 is its family's). */
#define ICMP_FAM_PROTO			(FAM_IS_V6 ? IPPROTO_ICMPV6 : IPPROTO_ICMP)
#define ICMP_FAM_IPHDR_OFF(off, field)	\
	((off) + (FAM_IS_V6 ? offsetof(struct ipv6hdr, field) : offsetof(struct iphdr, field)))

/* icmp_quote_v4/v6 read the network header an ICMP error quotes at off. A
 * quote is translated only when it comes from where the error goes (quoted
 * source = outer destination, here) and holds the L4 header: not an IPv4
 * non-first fragment, no IPv6 extension headers. They fill k's addresses
 * (the quoted ones reversed, as the flow's entries have them) and
 * protocol, and return the quoted L4 header's offset, or 0 for a quote
 * not translated. */
static __always_inline __u32 icmp_quote_v4(struct __sk_buff *skb, __u32 off, const addr4_t here,
					   struct nat_v4_key *k)
{
	struct iphdr ip;

	if (bpf_skb_load_bytes(skb, off, &ip, sizeof(ip)) < 0)
		return 0;
	if (ip.version != 4 || ip.ihl < 5 || ip.saddr != here ||
	    (bpf_ntohs(ip.frag_off) & IP_OFFSET))
		return 0;
	k->src = ip.daddr;
	k->dst = ip.saddr;
	k->proto = ip.protocol;
	return off + ip.ihl * 4;
}

static __always_inline __u32 icmp_quote_v6(struct __sk_buff *skb, __u32 off, const addr6_t here,
					   struct nat_v6_key *k)
{
	struct ipv6hdr ip;

	if (bpf_skb_load_bytes(skb, off, &ip, sizeof(ip)) < 0)
		return 0;
	if (ip.version != 6 || !addr6_equal((const __u8 *)&ip.saddr, here))
		return 0;
	__builtin_memcpy(k->src, &ip.daddr, 16);
	__builtin_memcpy(k->dst, &ip.saddr, 16);
	k->proto = ip.nexthdr;
	return off + sizeof(ip);
}

/* icmp_quote_addr_v4/v6 write to over the quoted address at addr_off. In
 * IPv4 the quoted header checksum (quote_off: the quoted header) changes by
 * the opposite amount: net zero for the ICMP checksum. ICMPv6 has no such
 * field, so diff (from -> to) goes into the ICMPv6 checksum at icmp_csum. */
static __always_inline int icmp_quote_addr_v4(struct __sk_buff *skb, __u32 icmp_csum,
					      __u32 quote_off, __u32 addr_off,
					      const addr4_t from, const addr4_t to, __u32 diff)
{
	if (bpf_l3_csum_replace(skb, quote_off + offsetof(struct iphdr, check), from, to, 4) < 0 ||
	    bpf_skb_store_bytes(skb, addr_off, &to, 4, 0) < 0)
		return -1;
	return 0;
}

static __always_inline int icmp_quote_addr_v6(struct __sk_buff *skb, __u32 icmp_csum,
					      __u32 quote_off, __u32 addr_off,
					      const addr6_t from, const addr6_t to, __u32 diff)
{
	if (bpf_l4_csum_replace(skb, icmp_csum, 0, diff, 0) < 0 ||
	    bpf_skb_store_bytes(skb, addr_off, to, 16, 0) < 0)
		return -1;
	return 0;
}

#define FAMILY 4
#include "icmp_fam.h"
#define FAMILY 6
#include "icmp_fam.h"

#endif /* IPMASQ_LIB_ICMP_H */
