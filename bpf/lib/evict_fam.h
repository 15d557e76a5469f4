/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The notes of evict.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: nat_note_hash_v4, nat_note_hash_v6, nat_note_same_v4,
 * nat_note_same_v6, nat_cand_note_v4, nat_cand_note_v6.
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
 * hash that is empty or its own, else the first whose entry is gone or
 * assured (evict.h). A slot is written
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
	 * if still empty; else the first whose entry is gone, or may not go
	 * any more, is written over; when all may go, the new pair is not
	 * noted (there are others to take right there). */
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

#undef FAMILY
#include "family.h"
