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

/*
 * The NAT maps are plain hash maps: the kernel never evicts an entry behind
 * the programs' back (an LRU map evicts single entries, half a pair, an
 * idle established flow's included). When a new flow finds its map full,
 * one pair that is not assured is dropped to make room, as conntrack's
 * early_drop does, both halves together:
 *
 *   - TCP: not answered yet, or closing (a FIN or RST from the remote);
 *   - UDP: not a stream (a query and its answer, or unanswered);
 *   - ICMP echo: always (conntrack never assures them);
 *   - SCTP and GRE pairs: not assured yet (lib/fixed.h); ESP and the other
 *     address-only pairs: always (conntrack never assures them).
 *
 * Established TCP flows, UDP streams, node sockets' held tuples and inbound
 * flow records are never dropped for a new flow. A pair is judged by its
 * reply (dir 1) entry, which holds what the remote sent. When no pair can
 * be dropped the new flow is refused (drop-nat-table-full), and new flows
 * of that family are refused without another search for
 * NAT_FULL_BACKOFF_NS: the search walks the map (bpf_for_each_map_elem),
 * and a table full of established flows must not make every new flow's
 * packet walk it again.
 */

#define NAT_FULL_BACKOFF_NS	100000000ULL	/* 100 ms */

/* Per family (0: IPv4, 1: IPv6): until when (bpf_ktime_get_ns) new flows
 * are refused without a search. Pinned like the other maps: what a restart
 * finds in it delays a search by NAT_FULL_BACKOFF_NS at most. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 2);
} nat_full_until SEC(".maps");

/* nat_evictable says whether the pair whose reply entry has these flags
 * may be dropped for a new flow. */
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

/* The search looks at this many pairs that may go and drops the best of
 * them: a done pair before one in flight, then the one idle longest. The
 * map is walked from its first bucket on every search, and the first
 * candidate there is as likely as not a pair made a moment ago (a query
 * whose answer is on its way): conntrack looks at a few entries from the
 * new tuple's bucket and drops one of them. A bound keeps the walk short
 * when most pairs may go. */
#define NAT_EARLY_DROP_CANDIDATES 16

/* nat_search_allowed says whether a full map may be searched now for a
 * pair to drop; the time differences are signed (another CPU may have
 * moved until past the now this CPU read). */
static __always_inline __u64 *nat_search_allowed(__u32 family, __u64 now)
{
	__u64 *until = bpf_map_lookup_elem(&nat_full_until, &family);

	if (!until || (__s64)(now - *until) < 0)
		return NULL;
	return until;
}

#define FAMILY 4
#include "pressure_fam.h"
#define FAMILY 6
#include "pressure_fam.h"

#endif /* IPMASQ_LIB_PRESSURE_H */
