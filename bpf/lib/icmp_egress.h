/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * ICMP errors on egress.
 *
 * An ICMP error leaving the node about a packet of a translated flow quotes
 * that packet as the pod (or the node, forwarding it) received it: from the
 * remote to pod:pod port, the ingress translation already applied. The
 * remote knows the flow as remote -> SNAT address:NAT port and matches the
 * error against that, so the quote is put back into the remote's view: the
 * quoted destination address and port, the quoted IPv4 header checksum, the
 * quoted L4 checksum when the quote holds it, and every change carried into
 * the ICMP checksum (for ICMPv6 also its pseudo header). An error a pod sent
 * (port unreachable) also leaves from the flow's SNAT address; one the node
 * sent (fragmentation needed / packet too big while forwarding to a pod
 * behind a smaller MTU, time exceeded) keeps the node's source.
 *
 * The flow is found by its egress (dir 0) entry, the quoted tuple reversed.
 * A pod's error about a flow a remote opened (an inbound record, dir 2)
 * passes untranslated. An error from a masquerade source that quotes no
 * flow it knows and goes to a masqueraded destination is dropped and
 * counted: it would carry the pod's address out.
 */

#ifndef IPMASQ_LIB_ICMP_EGRESS_H
#define IPMASQ_LIB_ICMP_EGRESS_H

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
#include "decision.h"
#include "rewrite.h"
#include "icmp.h"

/* quote_egress_ports reads the quote's L4 header at off into the ports of
 * the flow's egress key and returns the offset of the quoted port to
 * rewrite (0: none, an address-only flow). */
static __always_inline int quote_egress_ports(struct __sk_buff *skb, __u8 proto, __u32 off,
					      __be16 *sport, __be16 *dport, __u32 *port_off)
{
	struct {
		__u8 type;
		__u8 code;
		__be16 b;
		__be16 c;
	} h;

	*sport = 0;
	*dport = 0;
	*port_off = 0;
	switch (proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		if (bpf_skb_load_bytes(skb, off, &h, 4) < 0)
			return -1;
		/* quoted remote:rport -> pod:pport is the flow pod:pport -> remote:rport */
		__builtin_memcpy(dport, &h, 2);
		*sport = h.b;
		*port_off = off + 2;
		return 0;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		if (bpf_skb_load_bytes(skb, off, &h, sizeof(h)) < 0)
			return -1;
		/* an echo reply to the pod carries the pod's identifier */
		if (h.type == (proto == IPPROTO_ICMP ? ICMP_ECHOREPLY : ICMPV6_ECHO_REPLY)) {
			*sport = h.c;
			*port_off = off + 4;
		}
		return 0;
	}
	return 0;
}

/* icmp_error_unmatched decides what happens to an ICMP error that quotes no
 * translated flow: the node's own pass, a masquerade source's is dropped
 * when its destination would be masqueraded. Subprograms of their own keep
 * decide_*'s stack out of the callers' frames. */
static __always_inline int icmp_error_unmatched(enum counter c)
{
	if (c != COUNTER_MASQUERADED) {
		count(c);
		return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
	}
	count(COUNTER_ICMP_ERR_UNMATCHED);
	return TC_ACT_SHOT;
}

static __noinline int icmp_error_unmatched_v4(struct __sk_buff *skb, const struct pkt *p,
					      const struct masq_rule *rule)
{
	__be32 snat;

	return icmp_error_unmatched(decide_v4(skb, p, rule, &snat));
}

static __noinline int icmp_error_unmatched_v6(struct __sk_buff *skb, const struct pkt *p,
					      const struct masq_rule *rule)
{
	struct nat_v6_val snat;

	return icmp_error_unmatched(decide_v6(skb, p, rule, &snat.addr));
}

/* NOT_TRANSLATED_ERROR is returned by egress_icmp_error_* for a packet that
 * is not an ICMP error about a translated flow: the caller goes on, and
 * drops it (icmp_error_unmatched_*) if it is an error from a masquerade
 * source to a masqueraded destination. It is no tc action. Returning
 * instead of calling keeps decide_*'s frames out of this one's chain
 * (the verifier's 512-byte limit covers the whole call chain). */
#define NOT_TRANSLATED_ERROR (-2)

/* egress_icmp_error_v4 returns the tc action for an ICMP error about a
 * translated flow, or NOT_TRANSLATED_ERROR. */
static __noinline int egress_icmp_error_v4(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 inner_off = p->l4_off + 8, inner_l4, port_off, addr_diff = 0;
	__u32 icmp_csum = p->l4_off + 2;
	struct nat_v4_key k = { .dir = DIR_EGRESS };
	const struct masq_rule *rule;
	struct nat_v4_val *v;
	struct iphdr ip;
	__be32 from, to;
	__be16 pto;
	int from_source;
	__u8 type;

	if (bpf_skb_load_bytes(skb, p->l4_off, &type, 1) < 0 || !is_icmp_error_v4(type))
		return NOT_TRANSLATED_ERROR;
	from_source = masq_source_v4(skb, p->v4.saddr, &rule);
	if (bpf_skb_load_bytes(skb, inner_off, &ip, sizeof(ip)) < 0 || ip.version != 4 ||
	    ip.ihl < 5 || ip.saddr != p->v4.daddr || (bpf_ntohs(ip.frag_off) & IP_OFFSET))
		goto unmatched;
	inner_l4 = inner_off + ip.ihl * 4;
	k.src = ip.daddr;
	k.dst = ip.saddr;
	k.proto = ip.protocol;
	if (quote_egress_ports(skb, ip.protocol, inner_l4, &k.sport, &k.dport, &port_off) < 0)
		goto unmatched;
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (!v) {
		/* A pod's error about a flow a remote opened (port unreachable
		 * for its probe) passes untranslated, as Linux passes it: the
		 * flow is the remote's, the pod answers from its own address. */
		k.dir = DIR_INBOUND;
		if (from_source && bpf_map_lookup_elem(&nat_v4, &k)) {
			count(COUNTER_SKIP_INBOUND_REPLY);
			return TC_ACT_UNSPEC;
		}
		goto unmatched;
	}
	from = ip.daddr;
	to = v->addr;
	pto = v->port;

	/* a pod's own error leaves from the flow's SNAT address */
	if (from_source &&
	    rewrite_v4(skb, p->l3_off, p->l3_off + offsetof(struct iphdr, saddr), p->v4.saddr, to,
		       IPPROTO_ICMP, 0, 0, 0, 0) < 0)
		goto err;
	/* quoted destination and quoted header checksum: net zero for the ICMP sum */
	if (bpf_l3_csum_replace(skb, inner_off + offsetof(struct iphdr, check), from, to, 4) < 0 ||
	    bpf_skb_store_bytes(skb, inner_off + offsetof(struct iphdr, daddr), &to, 4, 0) < 0)
		goto err;
	if (ip.protocol != IPPROTO_ICMP)
		addr_diff = bpf_csum_diff(&from, 4, &to, 4, 0);
	if (icmp_quote_port(skb, icmp_csum, ip.protocol, inner_l4, port_off, k.sport, pto,
			    addr_diff) < 0)
		goto err;
	count(COUNTER_ICMP_ERR_EGRESS);
	return TC_ACT_UNSPEC;
unmatched:
	return NOT_TRANSLATED_ERROR;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

static __noinline int egress_icmp_error_v6(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 inner_off = p->l4_off + 8, inner_l4 = inner_off + sizeof(struct ipv6hdr), port_off;
	__u32 icmp_csum = p->l4_off + 2, diff;
	struct nat_v6_key k = { .dir = DIR_EGRESS };
	const struct masq_rule *rule;
	struct nat_v6_val *v;
	struct ipv6hdr ip;
	__u8 from[16], to[16], src[16];
	int from_source;
	__be16 pto;
	__u8 type;

	if (bpf_skb_load_bytes(skb, p->l4_off, &type, 1) < 0 || !is_icmp_error_v6(type))
		return NOT_TRANSLATED_ERROR;
	from_source = masq_source_v6(skb, p->v6.saddr, &rule);
	/* Quotes with extension headers are not translated. */
	if (bpf_skb_load_bytes(skb, inner_off, &ip, sizeof(ip)) < 0 || ip.version != 6 ||
	    !addr6_equal((const __u8 *)&ip.saddr, p->v6.daddr))
		goto unmatched;
	__builtin_memcpy(k.src, &ip.daddr, 16);
	__builtin_memcpy(k.dst, &ip.saddr, 16);
	k.proto = ip.nexthdr;
	if (quote_egress_ports(skb, ip.nexthdr, inner_l4, &k.sport, &k.dport, &port_off) < 0)
		goto unmatched;
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (!v) {
		/* See egress_icmp_error_v4. */
		k.dir = DIR_INBOUND;
		if (from_source && bpf_map_lookup_elem(&nat_v6, &k)) {
			count(COUNTER_SKIP_INBOUND_REPLY);
			return TC_ACT_UNSPEC;
		}
		goto unmatched;
	}
	__builtin_memcpy(from, &ip.daddr, 16);
	__builtin_memcpy(to, v->addr, 16);
	pto = v->port;
	diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);

	/* a pod's own error: the outer source is in the ICMPv6 pseudo header */
	if (from_source) {
		__builtin_memcpy(src, p->v6.saddr, 16);
		if (rewrite_v6(skb, p->l3_off + offsetof(struct ipv6hdr, saddr), src, to,
			       IPPROTO_ICMPV6, icmp_csum, 0, 0, 0) < 0)
			goto err;
	}
	/* quoted destination: ICMPv6 payload */
	if (bpf_l4_csum_replace(skb, icmp_csum, 0, diff, 0) < 0 ||
	    bpf_skb_store_bytes(skb, inner_off + offsetof(struct ipv6hdr, daddr), to, 16, 0) < 0)
		goto err;
	if (icmp_quote_port(skb, icmp_csum, ip.nexthdr, inner_l4, port_off, k.sport, pto, diff) < 0)
		goto err;
	count(COUNTER_ICMP_ERR_EGRESS);
	return TC_ACT_UNSPEC;
unmatched:
	return NOT_TRANSLATED_ERROR;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

#endif /* IPMASQ_LIB_ICMP_EGRESS_H */
