/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Table pressure: conntrack's early drop for the NAT maps. */

#ifndef IPMASQ_LIB_PRESSURE_H
#define IPMASQ_LIB_PRESSURE_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "flow.h"
#include "evict.h"

/*
 * The NAT maps are plain hash maps: the kernel never evicts an entry behind
 * the programs' back (an LRU map evicts single entries, half a pair, an
 * idle established flow's included). When a new flow finds its map full,
 * one pair that is not assured is dropped to make room, as conntrack's
 * early_drop does, both halves together (or one inbound flow record):
 *
 *   - TCP: not answered yet, or closing (a FIN or RST from the remote, or
 *     the pod's RST);
 *   - UDP: not a stream (a query and its answer, or unanswered);
 *   - ICMP echo: always (conntrack never assures them);
 *   - SCTP and GRE pairs: not assured yet (lib/fixed.h); ESP and the other
 *     address-only pairs: always (conntrack never assures them);
 *   - any pair whose lifetime has passed (lib/flow.h), whether or not the
 *     agent's collector has run.
 *
 * Inbound flow records (dir 2) go by the same rules, their answer being
 * the pod's. Established TCP flows, UDP streams and node sockets' held
 * tuples are never dropped for a new flow while they live. A pair is
 * judged by its reply (dir 1) entry, which holds what the remote sent
 * (an expiry by both halves' stamps).
 *
 * The search reads NAT_EARLY_DROP_WINDOWS windows of NAT_EARLY_DROP_WINDOW
 * slots of the notes of evict.h, each from a random start (a table of 16
 * pairs or fewer is read whole), as conntrack
 * reads 8 buckets from the new tuple's hash: its cost is bounded whatever
 * the table's size, and it finds a pair that may go wherever the table
 * holds many (each is noted at its own hash). A table full of assured
 * flows refuses a new one (drop-nat-table-full) after those few slots
 * (their stale notes cleared on the way, so the next searches read empty
 * slots). Several CPUs search at once, each its own windows: the victim
 * is claimed with the stamp it was judged by (lib/flow.h), so a pair
 * answered, reopened or taken by another CPU meanwhile is kept, and the
 * search moves on to its next candidate.
 */

/* nat_done says whether the pair whose reply entry has these flags has
 * had its exchange: a UDP query answered, an ICMP echo answered, a TCP flow
 * closing. Early drop takes such a pair before one still waiting for its
 * answer (a query in flight). */
static __always_inline int nat_done(__u8 proto, __u8 flags)
{
	switch (proto) {
	case IPPROTO_TCP:
		return !!(flags & (NAT_F_FIN | NAT_F_RST));
	case IPPROTO_UDP:
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		return !!(flags & NAT_F_SEEN);
	}
	return 0;
}

/* The search reads NAT_EARLY_DROP_WINDOWS windows of NAT_EARLY_DROP_WINDOW
 * slots (conntrack: 8 buckets, about as many entries), weighs up to
 * NAT_EARLY_DROP_CANDIDATES pairs that may go among them, and drops the
 * best: an expired pair first, then a done pair before one in flight, then
 * the one idle longest. Under a DNS burst the done pairs are the answered
 * queries: a query made a moment ago, whose answer is on its way, is the
 * last taken. A search whose slots all hold notes costs 20 to 35 µs on
 * the development VM, several times conntrack's refusal
 * (docs/datapath-benchmarks.md). */
#define NAT_EARLY_DROP_WINDOWS		16
#define NAT_EARLY_DROP_WINDOW		1
#define NAT_EARLY_DROP_CANDIDATES	16

/* Candidate ranks: the higher goes first. */
#define EARLY_DROP_IN_FLIGHT	0
#define EARLY_DROP_DONE		1
#define EARLY_DROP_EXPIRED	2

#define FAMILY 4
#include "pressure_fam.h"
#define FAMILY 6
#include "pressure_fam.h"

#endif /* IPMASQ_LIB_PRESSURE_H */
