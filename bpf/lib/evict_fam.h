/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The notes of evict.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: struct nat_v4_mark, struct nat_v6_mark, nat_note_hash_v4,
 * nat_note_hash_v6, nat_note_same_v4, nat_note_same_v6,
 * nat_cand_note_v4, nat_cand_note_v6, nat_cand_mark_run_v4,
 * nat_cand_mark_run_v6, nat_cand_mark_set_v4, nat_cand_mark_set_v6,
 * nat_cand_mark_v4, nat_cand_mark_v6, nat_mark_scratch_v4,
 * nat_mark_scratch_v6.
 */

#include "family.h"

/* The key's size in 32-bit words (a key is 4-byte aligned). */
#undef NAT_KEY_WORDS
#define NAT_KEY_WORDS (sizeof(FAM_T(nat, key)) / 4)

/* nat_note_hash_v4/v6 is the slot of key k's note, before the probes. */
static __always_inline __u32 FAM(nat_note_hash)(const FAM_T(nat, key) *k)
{
	const __u32 *w = (const __u32 *)k;
	__u32 h = nat_note_seed, i;

#pragma clang loop unroll(disable)
	for (i = 0; i < NAT_KEY_WORDS; i++)
		h = nat_note_mix(h, w[i]);
	return nat_note_fmix(h ^ (__u32)NAT_KEY_WORDS) % FAM(nat_note_slots);
}

/* nat_note_same_v4/v6 says whether note c holds key k. */
static __always_inline int FAM(nat_note_same)(const FAM_T(nat, cand) *c, const FAM_T(nat, key) *k)
{
	const __u32 *a = (const __u32 *)&c->key, *b = (const __u32 *)k;
	__u32 i, d = 0;

#pragma clang loop unroll(disable)
	for (i = 0; i < NAT_KEY_WORDS; i++)
		d |= a[i] ^ b[i];
	return !d;
}

/* nat_cand_note_v4/v6 notes the entry of key k, made at created, as a
 * candidate for early drop, at the first of NAT_NOTE_PROBES slots from its
 * hash that is empty or its own, else the first that is armed or whose
 * entry is gone or assured (evict.h). A slot is written
 * created_ns last and zeroed first: a reader that sees the same created_ns
 * before and after its lookup had a whole key (and checks it against the
 * map anyway). Costs the hash, one to four slot reads (one or two cache
 * lines) and a 24 (48) byte write. Its loops are not unrolled: unrolled,
 * they took its callers' frames (near the 512-byte limit) over. */
static __always_inline void FAM(nat_cand_note)(const FAM_T(nat, key) *k, __u64 created)
{
	__u32 slot = FAM(nat_note_hash)(k), i, s;
	FAM_T(nat, cand) *c;
	FAM_T(nat, val) *v;
	__u32 *f, fam = FAM_IS_V6;

#pragma clang loop unroll(disable)
	for (i = 0; i < NAT_NOTE_PROBES; i++) {
		s = (slot + i) % FAM(nat_note_slots);
		c = bpf_map_lookup_elem(&FAM(nat_cand), &s);
		if (!c)
			return;
		if (!*(volatile __u64 *)&c->created_ns || FAM(nat_note_same)(c, k))
			goto write;
	}
	/* All hold other keys' notes: the slot this CPU's early drop emptied,
	 * if still empty; else the first that is armed (no lookup), or whose
	 * entry is gone, or may not go any more, is written over; when all
	 * may go, the new pair is not noted (there are others to take right
	 * there). */
	f = bpf_map_lookup_elem(&nat_note_free, &fam);
	if (f && *f) {
		s = *f - 1;
		*f = 0;
		c = bpf_map_lookup_elem(&FAM(nat_cand), &s);
		if (c && !*(volatile __u64 *)&c->created_ns)
			goto write;
	}
#pragma clang loop unroll(disable)
	for (i = 0; i < NAT_NOTE_PROBES; i++) {
		s = (slot + i) % FAM(nat_note_slots);
		c = bpf_map_lookup_elem(&FAM(nat_cand), &s);
		if (!c)
			return;
		if (*(volatile __u64 *)&c->created_ns & NAT_NOTE_ARMED)
			goto write;
		v = bpf_map_lookup_elem(&FAM(nat), &c->key);
		if (!v || (c->key.dir != DIR_INBOUND && c->key.dir != DIR_INGRESS) ||
		    !nat_evictable(c->key.proto, *(volatile __u8 *)&v->flags))
			goto write;
	}
	return;
write:
	*(volatile __u64 *)&c->created_ns = 0;
	__builtin_memcpy(&c->key, k, sizeof(*k));
	*(volatile __u64 *)&c->created_ns = created ? created : 1;
}

/* The arguments of nat_cand_mark_run, per CPU (a tc program runs to
 * its end on its CPU): a global function takes no pointer on every
 * kernel, and its slot index, a map key, lives here rather than on a
 * stack whose callers are near the 512-byte limit. */
FAM_T(nat, mark) {
	FAM_T(nat, key) key;
	__u64 created;
	__u64 to;
	__u32 slot;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, FAM_T(nat, mark));
	__uint(max_entries, 1);
} FAM(nat_mark_scratch) SEC(".maps");

/* nat_cand_mark_run_v4/v6 writes to, to the note of this CPU's
 * nat_mark_scratch key at its probes (evict.h): 0 clears it (its entry
 * deleted), stamp | NAT_NOTE_ARMED arms it (its pair may no longer go, as
 * of that stamp of its entry). Only a note of the entry made at created
 * (or an armed one) is touched: one a newer entry of the key wrote is not
 * its. Same write discipline as nat_cand_note's: created_ns is checked
 * unchanged just before the write (a note written over meanwhile is left
 * alone, but for the instant between the check and the write). Costs the
 * hash and one slot read (NAT_NOTE_PROBES when the note is not there:
 * adjacent slots, one or two cache lines). A global function that takes
 * no pointer: the verifier checks it once, not at each of its callers'
 * paths. Returns 0. */
__noinline int FAM(nat_cand_mark_run)(void)
{
	FAM_T(nat, mark) *m;
	FAM_T(nat, cand) *c;
	__u64 was;
	__u32 i;

	/* What lives across the loop's calls is in m: no spill to a stack
	 * the callers' frames have used up. */
	m = bpf_map_lookup_elem(&FAM(nat_mark_scratch), (const void *)&nat_mark_zero);
	if (!m)
		return 0;
	m->slot = FAM(nat_note_hash)(&m->key);
#pragma clang loop unroll(disable)
	for (i = 0; i < NAT_NOTE_PROBES; i++) {
		c = bpf_map_lookup_elem(&FAM(nat_cand), &m->slot);
		if (!c)
			return 0;
		was = *(volatile __u64 *)&c->created_ns;
		if (was && FAM(nat_note_same)(c, &m->key)) {
			if (was != m->created && !(was & NAT_NOTE_ARMED))
				return 0; /* a newer entry's */
			if (*(volatile __u64 *)&c->created_ns == was)
				*(volatile __u64 *)&c->created_ns = m->to;
			return 0;
		}
		m->slot = (m->slot + 1) % FAM(nat_note_slots);
	}
	return 0;
}

/* nat_cand_mark_set_v4/v6 sets nat_cand_mark_run's arguments: key k,
 * its entry made at created, to (0 clears the note, stamp |
 * NAT_NOTE_ARMED arms it), and says whether it could. A caller whose
 * call chain has no room for another frame has its own caller run
 * nat_cand_mark_run. */
static __always_inline int FAM(nat_cand_mark_set)(const FAM_T(nat, key) *k, __u64 created, __u64 to)
{
	const __u32 *w = (const __u32 *)k;
	FAM_T(nat, mark) *m;
	__u32 i;

	m = bpf_map_lookup_elem(&FAM(nat_mark_scratch), (const void *)&nat_mark_zero);
	if (!m)
		return 0;
	/* word by word: a copy the compiler may hoist above the lookup
	 * would spill the whole key to the caller's stack */
#pragma clang loop unroll(disable)
	for (i = 0; i < NAT_KEY_WORDS; i++)
		((__u32 *)&m->key)[i] = w[i];
	m->created = created ? created : 1;
	m->to = to;
	return 1;
}

/* nat_cand_mark_v4/v6 runs nat_cand_mark_run for key k, its entry made at
 * created: to 0 clears the note, stamp | NAT_NOTE_ARMED arms it. */
static __always_inline void FAM(nat_cand_mark)(const FAM_T(nat, key) *k, __u64 created, __u64 to)
{
	if (FAM(nat_cand_mark_set)(k, created, to))
		FAM(nat_cand_mark_run)();
}

#undef FAMILY
#include "family.h"
