/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Eviction notes: the pairs early drop may look at, noted at a slot of
 * their own hash when they are made (or start to close), armed when they
 * are assured, so that its cost is bounded whatever the table's size. */

#ifndef IPMASQ_LIB_EVICT_H
#define IPMASQ_LIB_EVICT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <linux/in.h>
#include <linux/in6.h>
#include "types.h"
#include "maps.h"

/*
 * Conntrack's early drop looks at the entries of 8 hash buckets from the
 * new tuple's own (nf_conntrack_core.c, early_drop): a bounded sample that
 * finds an unassured entry wherever the table holds many. A BPF program
 * can neither start a hash map walk at a chosen bucket nor read a bucket's
 * chain, so the programs keep a shadow of the table's buckets themselves:
 * an array per family (nat_cand_v4/v6), as many slots as the table holds
 * pairs (the loader sizes it), in which each entry that
 * is not assured is noted at the slot its key hashes to:
 *
 *   - each new pair's reply (dir 1) key, a node flow's held tuple excepted
 *     (never dropped);
 *   - each new or reopened inbound flow record's key (dir 2);
 *   - a reply key again when the remote's first FIN or RST arrives, or the
 *     pod's RST (an established pair that starts closing may go again),
 *     and an inbound record's key when either side's first FIN or RST
 *     arrives, an SCTP pair's when its association ends.
 *
 * A note goes to the first of NAT_NOTE_PROBES slots from its hash that is
 * empty or already holds its key; when all hold other keys, to the slot
 * this CPU's last early drop emptied (nat_note_free: a new flow at a full
 * table comes right after its early drop), else to the first that is
 * armed (below) or whose entry is gone or assured (one lookup each): a
 * note of a pair that may go is kept before a new one. When all of them
 * may go and no slot was emptied, the new pair is not noted (there are
 * eight to take right there). A slot holds the key and the entry's
 * created_ns (0: empty). Early drop (pressure.h) reads windows of
 * adjacent slots from random starts: the notes lie where their keys hash
 * (with a seed the loader draws, so that nobody can aim flows at a few
 * slots), so any window is a uniform sample of them.
 *
 * A note is armed (NAT_NOTE_ARMED in created_ns, with the stamp of its
 * entry then) by the program that makes its pair stop being one that may
 * go: the remote's answer to a TCP pair (the pod's, an inbound record's),
 * a UDP pair becoming a stream, an SCTP or GRE pair assured (nat_cand_mark,
 * at the note's probes). An armed note costs a search no lookup until its
 * pair's lifetime, counted from that stamp, could have passed (an
 * established flow idle for its lifetime may go whatever the collector has
 * done): then the search looks it up, and arms it again with the entry's
 * stamp if it is alive. So the search looks up pairs that may go, and
 * almost nothing else. Its pair starting to close notes it again, unarmed.
 * A note the answer does not find at its probes (one written to the slot
 * an early drop emptied) stays unarmed until a search meets it, looks its
 * pair up, and arms it; so does a note whose answer raced its writing. A
 * note of an entry gone is cleared by the collector that deleted it, by
 * the early drop that did, or by the search that meets it.
 */

/* created_ns of an armed note: the rest is its entry's stamp when armed
 * (the clock's nanoseconds never reach bit 63). */
#define NAT_NOTE_ARMED	(1ULL << 63)

/* Probes of a note on collision. */
#define NAT_NOTE_PROBES	8

/* The arrays' default size; the loader sizes them to the NAT map's pairs
 * and sets the sizes below. */
#define NAT_CAND_SLOTS	4096

/* Set by the loader (bpf.Load): the slots of each family's array (a slot
 * is a hash modulo this: the array is exactly as large as the table's
 * pairs, the notes of pairs that may go as dense as they can be), and the
 * hash's seed. */
const volatile __u32 nat_note_slots_v4 = NAT_CAND_SLOTS;
const volatile __u32 nat_note_slots_v6 = NAT_CAND_SLOTS;
const volatile __u32 nat_note_seed = 0;

/* The key of the per-CPU scratch maps of one value, a read-only global:
 * a key on the stack would add to the frames of the programs' call
 * chains, near 512 bytes. */
const volatile __u32 nat_mark_zero = 0;

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

/* Per CPU and family (0: IPv4, 1: IPv6): 1 + the slot whose note this
 * CPU's last early drop cleared (0: none, or used). A new flow at a full
 * table follows its early drop on the same CPU: when its own probes hold
 * other pairs' notes that may all go, its note takes the victim's slot, so
 * that churn at a full table loses no notes (a pair never noted is out of
 * the search's reach). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 2);
} nat_note_free SEC(".maps");

/* nat_evictable says whether the pair whose reply entry (or the inbound
 * record) has these flags may be dropped for a new flow (pressure.h), and
 * so is worth a note. */
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

/* nat_note_mix folds one 32-bit word into hash h (murmur3's body). */
static __always_inline __u32 nat_note_mix(__u32 h, __u32 w)
{
	w *= 0xcc9e2d51;
	w = (w << 15) | (w >> 17);
	w *= 0x1b873593;
	h ^= w;
	h = (h << 13) | (h >> 19);
	return h * 5 + 0xe6546b64;
}

/* nat_note_fmix is murmur3's finalizer: every bit of h moves the slot. */
static __always_inline __u32 nat_note_fmix(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	return h ^ (h >> 16);
}

#define FAMILY 4
#include "evict_fam.h"
#define FAMILY 6
#include "evict_fam.h"

#endif /* IPMASQ_LIB_EVICT_H */
