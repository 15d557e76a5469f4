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
 * adjacent slots of the notes of evict.h, each from a random start (a
 * table of NAT_EARLY_DROP_SLOTS pairs or fewer is read whole), and looks
 * up the pairs of at most NAT_EARLY_DROP_LOOKUPS notes, as conntrack reads
 * the entries of 8 buckets from the new tuple's hash: its cost is bounded
 * whatever the table's size, and it finds a pair that may go wherever the
 * table holds many (each is noted at its own hash). The notes of assured
 * pairs are armed (evict.h): skipped without a lookup until their pair
 * could have expired, so a table full of assured flows refuses a new one
 * (drop-nat-table-full) after reading a few cache lines of notes. A note
 * still unarmed of a pair assured since (stale) costs the lookup that
 * arms it. Several CPUs search at once, each its own windows: the victim
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
 * adjacent slots, each from a random start (conntrack: 8 adjacent buckets
 * from the new tuple's hash), and looks up the pairs of at most
 * NAT_EARLY_DROP_LOOKUPS of the notes it finds there that are worth it
 * (not armed, or armed and past their lifetime: early_drop_worth; a table
 * of up to NAT_EARLY_DROP_SLOTS slots is read whole, every such note
 * looked up). Reading a slot is cheap (a window is a few cache lines of
 * one page); the pair's lookup in the NAT map is what costs (a bucket and
 * an element at random in a map of up to millions of entries: cache and
 * TLB misses), so the lookups are what is bounded. It
 * weighs the pairs that may go among them and drops the best: an expired
 * pair first, then a done pair before one in flight, then the one idle
 * longest. Under a DNS burst the done pairs are the answered queries: a
 * query made a moment ago, whose answer is on its way, is the last taken.
 * Once the best two weighed are expired or done nothing better is to be
 * found, and the search stops there, as it does once it has weighed
 * NAT_EARLY_DROP_CANDIDATES (in flight, all of them: the idlest of four
 * goes; a small table's are all weighed). docs/datapath-benchmarks.md has
 * the figures. */
#define NAT_EARLY_DROP_WINDOWS		4
#define NAT_EARLY_DROP_WINDOW		8
#define NAT_EARLY_DROP_SLOTS		(NAT_EARLY_DROP_WINDOWS * NAT_EARLY_DROP_WINDOW)
#define NAT_EARLY_DROP_LOOKUPS		8
#define NAT_EARLY_DROP_CANDIDATES	4

/* early_drop_worth says whether a note whose created_ns is created, of a
 * key of proto, is worth a lookup as of now: a note not armed (its pair
 * may go), or an armed one whose pair's lifetime as an assured pair,
 * counted from the stamp it was armed with, has passed (its pair may have
 * expired; a packet since moved its stamp on, so the lookup tells). */
static __always_inline int early_drop_worth(const struct masq_config *cfg, __u64 created, __u8 proto, __u64 now)
{
	__u8 flags = NAT_F_SEEN;

	if (!created)
		return 0;
	if (!(created & NAT_NOTE_ARMED))
		return 1;
	if (proto == IPPROTO_UDP)
		flags |= NAT_F_STREAM;
	return nat_expired(cfg, proto, flags, created & ~NAT_NOTE_ARMED, now);
}

/* Candidate ranks: the higher goes first. */
#define EARLY_DROP_IN_FLIGHT	0
#define EARLY_DROP_DONE		1
#define EARLY_DROP_EXPIRED	2

#define FAMILY 4
#include "pressure_fam.h"
#define FAMILY 6
#include "pressure_fam.h"

#endif /* IPMASQ_LIB_PRESSURE_H */
