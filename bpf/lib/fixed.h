/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * SCTP and every protocol without ports: pairs whose NAT port is fixed.
 *
 * SCTP keeps the pod's port: its CRC32c covers the SCTP packet but not the
 * IP header, so translating the address alone leaves it valid, and nothing
 * in the program has to recompute a CRC over the whole packet (no helper
 * does; a software CRC per packet would cost more than the rest of the
 * program). The price: two pods with the same source port to the same
 * remote address and port cannot share the SNAT address; the second
 * association's packets are dropped and counted (pair-taken). Linux would
 * move it to another port and recompute the CRC.
 *
 * GRE, ESP, AH, other IP protocols and the ICMP types that are neither
 * echo nor errors have no ports: they are translated address-only, one
 * pair per (pod, remote, protocol). The reply entry {remote, SNAT, 0, 0,
 * proto} can belong to one pod only, so a second pod talking the same
 * protocol to the same remote is dropped and counted (pair-taken) rather
 * than sent out with a translation whose answers would reach the first
 * pod. Of these, ICMPv6, DCCP and UDP-Lite have a checksum over a pseudo
 * header, which is kept right (DCCP and UDP-Lite ports are left alone).
 *
 * Entries carry the NAT "port" (the pod's SCTP port, or 0) so that the
 * collector and the dumps treat them like the other pairs.
 *
 * Assurance (what early drop spares, lib/pressure.h: a reply entry with
 * NAT_F_SEEN) follows conntrack's per protocol: an SCTP association is
 * assured when the remote's COOKIE-ACK completes it (or, on another path
 * of the association, its HEARTBEAT-ACK answers), not on its INIT-ACK, and
 * evictable again once a SHUTDOWN or ABORT from either side ends it
 * (sctp_can_early_drop); a GRE pair when the remote answers (conntrack
 * assures it from its next packet on); ESP, AH and every other protocol
 * never, as conntrack tracks them as generic and never assures them. A new
 * pair of any of them meeting a full table drops a pair that is not
 * assured for itself, as TCP and UDP flows do.
 */

#ifndef IPMASQ_LIB_FIXED_H
#define IPMASQ_LIB_FIXED_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <asm-generic/errno-base.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "decision.h"
#include "flow.h"
#include "evict.h"
#include "rewrite.h"
#include "frag.h"

/* SCTP chunk types (RFC 9260) that move a pair's assurance. */
#define SCTP_CID_HEARTBEAT_ACK		5
#define SCTP_CID_ABORT			6
#define SCTP_CID_SHUTDOWN		7
#define SCTP_CID_SHUTDOWN_ACK		8
#define SCTP_CID_COOKIE_ACK		11
#define SCTP_CID_SHUTDOWN_COMPLETE	14

/* egress_fixed_v4/v6: a new pair found the table full. */
#define FIXED_FULL	0x7fff

/* Assurance changes of fixed_assurance. */
#define FIXED_KEEP	0
#define FIXED_ASSURE	1	/* the remote completed the exchange: set NAT_F_SEEN */
#define FIXED_UNASSURE	2	/* an SCTP association ends: clear NAT_F_SEEN */

/* fixed_assurance says how packet p of a fixed pair, in direction dir,
 * changes the pair's assurance; for SCTP it reads the packet's first chunk
 * type (a COOKIE-ACK or a SHUTDOWN comes first in its packet). */
static __always_inline int fixed_assurance(struct __sk_buff *skb, const struct pkt *p, int dir)
{
	__u8 chunk;

	if (p->proto == IPPROTO_GRE)
		return dir == DIR_INGRESS ? FIXED_ASSURE : FIXED_KEEP;
	if (p->kind != PKT_SCTP || bpf_skb_load_bytes(skb, p->l4_off + 12, &chunk, 1) < 0)
		return FIXED_KEEP;
	switch (chunk) {
	case SCTP_CID_COOKIE_ACK:
	case SCTP_CID_HEARTBEAT_ACK:
		return dir == DIR_INGRESS ? FIXED_ASSURE : FIXED_KEEP;
	case SCTP_CID_ABORT:
	case SCTP_CID_SHUTDOWN:
	case SCTP_CID_SHUTDOWN_ACK:
	case SCTP_CID_SHUTDOWN_COMPLETE:
		return FIXED_UNASSURE;
	}
	return FIXED_KEEP;
}

/* fixed_assure applies an assurance change to a reply entry's flags. */
static __always_inline void fixed_assure(__u8 *flags, int how)
{
	if (how == FIXED_ASSURE && !(*flags & NAT_F_SEEN))
		*flags |= NAT_F_SEEN;
	else if (how == FIXED_UNASSURE && (*flags & NAT_F_SEEN))
		*flags &= ~NAT_F_SEEN;
}

static __always_inline void count_fixed_new(const struct pkt *p, const struct masq_rule *rule)
{
	count(COUNTER_NAT_NEW);
	count(p->kind == PKT_SCTP ? COUNTER_NAT_NEW_SCTP : COUNTER_NAT_NEW_ADDR_ONLY);
	if (rule)
		count(COUNTER_NAT_NEW_BY_RULE);
}

/* The L4 checksum an address-only rewrite must fix: those that cover a
 * pseudo header (ICMPv6; DCCP and UDP-Lite, whose ports are left alone). */
static __always_inline __u32 fixed_csum_off(const struct pkt *p)
{
	switch (p->proto) {
	case IPPROTO_ICMPV6:
		return p->l4_off + 2;
	case IPPROTO_DCCP:
	case IPPROTO_UDPLITE:
		return p->l4_off + 6;
	}
	return 0;
}

#define FAMILY 4
#include "fixed_fam.h"
#define FAMILY 6
#include "fixed_fam.h"

#endif /* IPMASQ_LIB_FIXED_H */
