/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Inbound flows: flows a remote opened toward a masquerade source. */

#ifndef IPMASQ_LIB_INBOUND_H
#define IPMASQ_LIB_INBOUND_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "decision.h"
#include "flow.h"
#include "evict.h"
#include "pressure.h"
#include "unmasq.h"
#include <asm-generic/errno-base.h>
#include <linux/pkt_cls.h>

/*
 * A flow a remote opens toward a masquerade source (a pod reachable by
 * routing: BGP, a load balancer with IP targets) must be answered from the
 * pod's own address: Linux never translates the replies of a connection it
 * did not masquerade. The ingress program records such a flow (dir 2, keyed
 * by the pod's reply tuple) when its first packet arrives; on egress, a
 * packet without a NAT pair that matches a record passes untranslated.
 */

#define FAMILY 4
#include "inbound_fam.h"
#define FAMILY 6
#include "inbound_fam.h"

/* egress_no_pair results: what happens to an egress packet without a NAT
 * pair. */
#define NO_PAIR_PASS	0	/* leaves untranslated (counted here) */
#define NO_PAIR_CREATE	1	/* starts a flow: decide, and make a pair */
#define NO_PAIR_PICKUP	2	/* a masquerade source's mid-stream TCP segment: decide, and make a pair */
#define NO_PAIR_ORPHAN	3	/* a masquerade source's RST or SYN-ACK: decide; dropped if masqueraded */

/* egress_no_pair sorts an egress packet that has no NAT pair. A reply of an
 * inbound flow passes untranslated. A flow's first packet gets a pair. A
 * masquerade source's mid-stream TCP segment (its pair evicted, lost to a
 * race, or never made: a node migrated from iptables with open flows) is
 * picked up as Linux does with nf_conntrack_tcp_loose=1: it gets a pair,
 * its own port when free, and the connection carries on. A RST or SYN-ACK
 * starts nothing (Linux finds them INVALID and sends them untranslated):
 * here they are dropped when masqueraded, never sent with the source's
 * address. The node's own packets start pairs only as flows (a remap). */
static __always_inline int egress_no_pair(const struct pkt *p, int is_v6, int node)
{
	if (is_v6 ? inbound_reply_v6(p) : inbound_reply_v4(p)) {
		count(COUNTER_SKIP_INBOUND_REPLY);
		return NO_PAIR_PASS;
	}
	if (flow_start(p, DIR_EGRESS))
		return NO_PAIR_CREATE;
	if (node) {
		count(COUNTER_SKIP_NOT_FLOW_START);
		return NO_PAIR_PASS;
	}
	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & (NAT_F_RST | PKT_F_SYN)))
		return NO_PAIR_PICKUP;
	return NO_PAIR_ORPHAN;
}

#endif /* IPMASQ_LIB_INBOUND_H */
