/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Table pressure: conntrack's early drop for the NAT maps. */

#ifndef IPMASQ_LIB_PRESSURE_H
#define IPMASQ_LIB_PRESSURE_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "compat.h"
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
 *   - TCP: not answered yet, or closing (a FIN or RST from the remote);
 *   - UDP: not a stream (a query and its answer, or unanswered);
 *   - ICMP echo: always (conntrack never assures them);
 *   - SCTP and GRE pairs: not assured yet (lib/fixed.h); ESP and the other
 *     address-only pairs: always (conntrack never assures them).
 *
 * Inbound flow records (dir 2) go by the same rules, their answer being
 * the pod's. Established TCP flows, UDP streams and node sockets' held
 * tuples are never dropped for a new flow. A pair is judged by its reply
 * (dir 1) entry, which holds what the remote sent.
 *
 * The search looks only at the candidates of evict.h, at most NAT_EARLY_
 * DROP_SLOTS slots from the oldest one not consumed: its cost is bounded
 * whatever the table's size, and a table full of assured flows refuses a
 * new one (drop-nat-table-full) after those few lookups, or after one
 * when every slot has been consumed. One CPU searches at a time (the
 * others wait for it a few microseconds, or refuse), and the victim is
 * claimed with the stamp it was judged by (lib/flow.h): a pair answered
 * or reopened meanwhile is kept.
 */

/* nat_evictable says whether the pair whose reply entry (or the inbound
 * record) has these flags may be dropped for a new flow. */
static __always_inline int nat_evictable(__u8 proto, __u8 flags)
{
	if (flags & NAT_F_HOST)
		return 0;
	switch (proto) {
	case IPPROTO_TCP:
		return !(flags & NAT_F_SEEN) || (flags & (NAT_F_FIN | NAT_F_RST));
	case IPPROTO_UDP:
		return !(flags & NAT_F_STREAM);
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		return 1;
	}
	return !(flags & NAT_F_SEEN);
}

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

/* The search weighs up to this many candidates of the ring (conntrack: 8
 * buckets, about as many entries) and drops the best pair among them: a
 * done pair before one in flight, then the one idle longest. The oldest
 * notes come first: under a DNS burst they are the answered queries, and a
 * query made a moment ago, whose answer is on its way, is the last taken.
 * It reads at most NAT_EARLY_DROP_SLOTS slots; the slots of pairs answered
 * since they were noted (most of them, on a busy node) are consumed on the
 * way. Each slot costs about three cache misses in a large table (the
 * slot, the bucket, the entry): 64 slots made a refusal 50 to 77 µs at
 * 64 Ki to 1 Mi entries, 16 keep it near conntrack's (8 buckets). */
#define NAT_EARLY_DROP_CANDIDATES 16
#define NAT_EARLY_DROP_SLOTS 16

/* A walker older than this has been preempted (a test run; tc programs run
 * in softirq): its lock is taken over. */
#define NAT_WALKER_STALE_NS	1000000ULL	/* 1 ms */

/* How many times a CPU reads the walker's lock while another CPU searches,
 * before it gives up and refuses its flow (about 10 µs; a search takes 1 to
 * 3 µs). */
#define NAT_WALKER_WAIT_READS	2048
/* The wait in the compat build's loop (lib/compat.h): the verifier follows
 * a bounded loop through every iteration, and one path may take at most
 * 8192 branches (four an iteration here). */
#define NAT_WALKER_WAIT_READS_COMPAT	2000

/* nat_walker_free_cb is bpf_loop's (compat_loop's) callback while waiting for the walker
 * of family *fam: stops once there is none (or a stale one). */
static long nat_walker_free_cb(__u64 i, void *fam)
{
	struct nat_drop_state *s = bpf_map_lookup_elem(&nat_drop, fam);
	__u64 w;

	if (!s)
		return 1;
	w = *(volatile __u64 *)&s->walker;
	return !w || (__s64)(bpf_ktime_get_ns() - w) > (__s64)NAT_WALKER_STALE_NS;
}

/* nat_walker_wait waits for the walker of family fam to finish (or go
 * stale), a few microseconds at most. A global function: the verifier
 * checks it, and the compat build's loop (lib/compat.h), once. Returns 0. */
__noinline int nat_walker_wait(__u32 fam)
{
	compat_loop(NAT_WALKER_WAIT_READS, NAT_WALKER_WAIT_READS_COMPAT, nat_walker_free_cb, &fam);
	return 0;
}

/* nat_walker_lock makes this CPU family's one walker, waiting for another
 * one a few microseconds; returns its stamp (to unlock with), or 0. */
static __always_inline __u64 nat_walker_lock(struct nat_drop_state *s, __u32 fam)
{
	__u64 now = bpf_ktime_get_ns(), w = *(volatile __u64 *)&s->walker;

	if (w && (__s64)(now - w) <= (__s64)NAT_WALKER_STALE_NS) {
		nat_walker_wait(fam);
		now = bpf_ktime_get_ns();
		w = *(volatile __u64 *)&s->walker;
		if (w && (__s64)(now - w) <= (__s64)NAT_WALKER_STALE_NS)
			return 0;
	}
	if (!now)
		now = 1;
	return atomic_cas64(&s->walker, w, now) == w ? now : 0;
}

/* nat_walker_unlock ends this CPU's walk (unless its lock was taken over). */
static __always_inline void nat_walker_unlock(struct nat_drop_state *s, __u64 me)
{
	atomic_cas64(&s->walker, me, 0);
}

#define FAMILY 4
#include "pressure_fam.h"
#define FAMILY 6
#include "pressure_fam.h"

#endif /* IPMASQ_LIB_PRESSURE_H */
