/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Flows that started unmasqueraded keep that decision for their life. */

#ifndef IPMASQ_LIB_UNMASQ_H
#define IPMASQ_LIB_UNMASQ_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "compat.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "flow.h"

/*
 * Linux decides NAT once per conntrack entry: a config change applies to
 * new flows, and a running flow keeps the source it started with. A
 * masqueraded flow keeps it through its NAT pair. A flow from a masquerade
 * source that was left alone because its destination was a non-masquerade
 * one is recorded here (unmasq_v4/v6, keyed by its egress tuple), and its
 * later packets pass untranslated on the record alone, even after the
 * operator made that destination masqueraded: a one-way UDP stream (syslog,
 * statsd) keeps the pod's address, and a TCP connection is not picked up
 * mid-stream with the node's. A flow that starts after the change is
 * decided by the new config.
 *
 * A record lives like a pair (nat_state's lifetimes) from the flags the
 * source's side showed: TCP unanswered until the source sends more than a
 * SYN, closing after its FIN, reset after its RST; UDP 30 s (its answers
 * are not seen here: an answered stream idle for 30 s to 2 min is decided
 * again where conntrack would keep it); ICMP echo 30 s. An expired record,
 * or a closed TCP record met by a new SYN (a new connection of the tuple,
 * for which conntrack makes a new entry), is deleted and the packet decided
 * again. The map is an LRU: an evicted record only means that its flow is
 * decided again by its next packet, which changes nothing unless the config
 * changed meanwhile. Records are written by flow starts and picked-up TCP
 * segments (NO_PAIR_CREATE, NO_PAIR_PICKUP), not by RSTs and SYN-ACKs,
 * which start nothing.
 *
 * Cost: a flow start toward a non-masquerade destination pays one lookup
 * and one insert more; its later packets take the record's lookup instead
 * of the inbound-reply, node-address and non-masquerade lookups
 * (docs/datapath.md has the figures).
 */

/* unmasq_flags is what packet p shows of its flow's state from the source's
 * side: its FIN or RST, and NAT_F_SEEN for a TCP segment other than a SYN
 * (the handshake went on, or the flow was picked up mid-stream). */
static __always_inline __u8 unmasq_flags(const struct pkt *p)
{
	__u8 flags = p->tcp_flags & (NAT_F_FIN | NAT_F_RST);

	if (p->proto == IPPROTO_TCP && !tcp_syn(p))
		flags |= NAT_F_SEEN;
	return flags;
}

/* unmasq_now is the records' clock: CLOCK_MONOTONIC at the tick's
 * resolution, half the cost of bpf_ktime_get_ns on the path of every
 * packet of an unmasqueraded flow; lifetimes are seconds. Records are
 * stamped and judged with this clock only. */
static __always_inline __u64 unmasq_now(void)
{
	return compat_coarse_ns();
}

#define FAMILY 4
#include "unmasq_fam.h"
#define FAMILY 6
#include "unmasq_fam.h"

#endif /* IPMASQ_LIB_UNMASQ_H */
