/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The counted inserts and deletes of natcount.h for one family: a
 * template, included once with FAMILY 4 and once with FAMILY 6 (see
 * family.h).
 *
 * Defines: nat_insert_v4, nat_insert_v6, nat_replace_v4, nat_replace_v6,
 * nat_delete_v4, nat_delete_v6, nat_delete_claimed_v4, nat_delete_claimed_v6.
 */

#include "family.h"

/* nat_insert_v4/v6 is bpf_map_update_elem(nat, k, v, BPF_NOEXIST), counted. */
static __always_inline long FAM(nat_insert)(const FAM_T(nat, key) *k, const FAM_T(nat, val) *v)
{
	long ret = bpf_map_update_elem(&FAM(nat), k, v, BPF_NOEXIST);

	if (ret == 0)
		nat_count_add(FAM_IS_V6, nat_class_of(k->dir, v->flags), 1);
	return ret;
}

/* nat_replace_v4/v6 is bpf_map_update_elem(nat, k, v, BPF_ANY) of an entry
 * the caller has claimed (or that is gone meanwhile), counted. */
static __always_inline long FAM(nat_replace)(const FAM_T(nat, key) *k, const FAM_T(nat, val) *v)
{
	FAM_T(nat, val) *o = bpf_map_lookup_elem(&FAM(nat), k);
	__u32 old = o ? nat_class_of(k->dir, o->flags) : NAT_CLASS_MAX;
	long ret = bpf_map_update_elem(&FAM(nat), k, v, BPF_ANY);

	if (ret == 0) {
		nat_count_add(FAM_IS_V6, old, -1);
		nat_count_add(FAM_IS_V6, nat_class_of(k->dir, v->flags), 1);
	}
	return ret;
}

/* nat_delete_v4/v6 is bpf_map_delete_elem(nat, k), counted. */
static __always_inline long FAM(nat_delete)(const FAM_T(nat, key) *k)
{
	FAM_T(nat, val) *o;
	__u8 flags = 0;
	long ret;

	/* Only a reply entry's class needs its value. */
	if (k->dir == DIR_INGRESS) {
		o = bpf_map_lookup_elem(&FAM(nat), k);
		if (!o)
			return -2; /* -ENOENT */
		flags = o->flags;
	}
	ret = bpf_map_delete_elem(&FAM(nat), k);
	if (ret == 0)
		nat_count_add(FAM_IS_V6, nat_class_of(k->dir, flags), -1);
	return ret;
}

/* nat_delete_claimed_v4/v6 is nat_delete of an entry the caller holds,
 * claimed (lib/flow.h), its flags read after the claim (or of the egress
 * entry of such a pair, whose class needs no flags): no lookup first. A
 * claimed entry's class does not change (NAT_F_HOST is set only by its
 * claimer's replacement), and no other party deletes it. */
static __always_inline long FAM(nat_delete_claimed)(const FAM_T(nat, key) *k, __u8 flags)
{
	long ret = bpf_map_delete_elem(&FAM(nat), k);

	if (ret == 0)
		nat_count_add(FAM_IS_V6, nat_class_of(k->dir, flags), -1);
	return ret;
}

#undef FAMILY
#include "family.h"
