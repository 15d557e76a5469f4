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
 * translated flow, given decide_*'s verdict on it: the node's own pass, a
 * masquerade source's is dropped when its destination would be
 * masqueraded. */
static __always_inline int icmp_error_unmatched(enum counter c)
{
	if (c != COUNTER_MASQUERADED) {
		count(c);
		return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
	}
	count(COUNTER_ICMP_ERR_UNMATCHED);
	return TC_ACT_SHOT;
}

/* NOT_TRANSLATED_ERROR is returned by egress_icmp_error_* for a packet that
 * is not an ICMP error about a translated flow: the caller goes on, and
 * drops it (icmp_error_unmatched_*) if it is an error from a masquerade
 * source to a masqueraded destination. It is no tc action. Returning
 * instead of calling keeps decide_*'s frames out of this one's chain
 * (the verifier's 512-byte limit covers the whole call chain). */
#define NOT_TRANSLATED_ERROR (-2)

#define FAMILY 4
#include "icmp_egress_fam.h"
#define FAMILY 6
#include "icmp_egress_fam.h"

#endif /* IPMASQ_LIB_ICMP_EGRESS_H */
