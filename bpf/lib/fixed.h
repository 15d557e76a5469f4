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
