/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The candidates of evict.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: nat_cand_note_v4, nat_cand_note_v6.
 */

#include "family.h"

/* nat_cand_note_v4/v6 notes the entry of key k, made at created, as a
 * candidate for early drop. A slot is written created_ns last and zeroed
 * first: a reader that sees the same created_ns before and after copying
 * the key has a whole key (and checks it against the map anyway). Costs an
 * atomic add on a shared line and a 24 (48) byte write. */
static __always_inline void FAM(nat_cand_note)(const FAM_T(nat, key) *k, __u64 created)
{
	__u32 idx = FAM_IS_V6; /* the family, then the slot (stack room) */
	struct nat_drop_state *s = bpf_map_lookup_elem(&nat_drop, &idx);
	FAM_T(nat, cand) *c;

	if (!s)
		return;
	idx = atomic_fetch_add64(&s->head, 1) & (NAT_CAND_SLOTS - 1);
	c = bpf_map_lookup_elem(&FAM(nat_cand), &idx);
	if (!c)
		return;
	atomic_store64(&c->created_ns, 0);
	__builtin_memcpy(&c->key, k, sizeof(*k));
	atomic_store64(&c->created_ns, created);
}

#undef FAMILY
#include "family.h"
