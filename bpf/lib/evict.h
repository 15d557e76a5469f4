/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Eviction candidates: the pairs early drop may look at, noted when they
 * are made (or start to close), so that its cost is bounded whatever the
 * table's size. */

#ifndef IPMASQ_LIB_EVICT_H
#define IPMASQ_LIB_EVICT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "compat.h"

/*
 * Conntrack's early drop looks at the entries of 8 hash buckets from the
 * new tuple's own (nf_conntrack_core.c, early_drop): a bounded sample. A
 * BPF program can neither start a hash map walk at a chosen bucket nor
 * read a bucket's chain, and bpf_for_each_map_elem from the first bucket
 * costs the whole map when few entries may go. So the programs keep the
 * sample themselves: a ring per family (nat_cand_v4/v6) of the keys of the
 * entries that were not assured when noted, in the order they were noted:
 *
 *   - each new pair's reply (dir 1) key, a node flow's held tuple excepted
 *     (never dropped);
 *   - each new inbound flow record's key (dir 2);
 *   - a reply key again when the remote's first FIN or RST arrives (an
 *     established pair that starts closing may go again).
 *
 * A slot holds the key and the entry's created_ns: an entry whose
 * created_ns differs is another flow of the same key (reopened or made
 * again), noted in a slot of its own if it may go. Early drop
 * (pressure.h) looks at NAT_EARLY_DROP_CANDIDATES slots from the oldest
 * one not consumed yet (nat_drop.tail), and only at those; the slots of
 * entries gone, reused or assured meanwhile are consumed as they are met.
 * The ring holds the last NAT_CAND_SLOTS notes: an older pair that never
 * got its answer is out of early drop's reach, and ends with its lifetime
 * (the collector, or a new flow taking its port over), as most of
 * conntrack's entries are out of its early drop's reach.
 */

/* A power of two (the slot is head & (NAT_CAND_SLOTS - 1)). */
#define NAT_CAND_SLOTS	4096

struct nat_v4_cand {
	struct nat_v4_key key;
	__u64 created_ns;	/* 0: an empty slot, or one being written */
};

struct nat_v6_cand {
	struct nat_v6_key key;
	__u64 created_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct nat_v4_cand);
	__uint(max_entries, NAT_CAND_SLOTS);
} nat_cand_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct nat_v6_cand);
	__uint(max_entries, NAT_CAND_SLOTS);
} nat_cand_v6 SEC(".maps");

/* The ring's state per family (0: IPv4, 1: IPv6). head is written by every
 * note (an atomic add, any CPU); tail and walker by early drop's one
 * walker; each on its own cache line. */
struct nat_drop_state {
	__u64 head;		/* notes made: the next note goes to slot head */
	__u64 pad0[7];
	__u64 tail;		/* the oldest slot early drop has not consumed */
	__u64 walker;		/* bpf_ktime_get_ns of the walker's start; 0: none */
	__u64 pad1[6];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct nat_drop_state);
	__uint(max_entries, 2);
} nat_drop SEC(".maps");

#define FAMILY 4
#include "evict_fam.h"
#define FAMILY 6
#include "evict_fam.h"

#endif /* IPMASQ_LIB_EVICT_H */
