/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The collector's compare-and-delete of natgc.h for one family: a template,
 * included once with FAMILY 4 and once with FAMILY 6 (see family.h).
 *
 * Defines: nat_gc_end_v4, nat_gc_end_v6.
 */

#include "family.h"

/* nat_gc_end_v4/v6 ends the pair of key k if it has expired (or force),
 * both halves, once claimed: the dir-1 entry of a whole pair (or the entry
 * itself, alone) is swapped to NAT_CLAIMED from the stamp judged. The
 * dir-0 entry goes first: until the claimed reply entry goes, no other
 * flow can take its port, and no SYN reopen the pair. */
static __always_inline __u32 FAM(nat_gc_end)(const FAM_T(nat, key) *k, __u32 force)
{
	struct masq_config *cfg = masq_cfg();
	FAM_T(nat, key) peer;
	FAM_T(nat, val) *v, *o;
	__u64 now = bpf_ktime_get_ns(), vl, ol = 0, last, created;
	const FAM_T(nat, key) *noted = k;
	__u8 flags;

	v = bpf_map_lookup_elem(&FAM(nat), k);
	if (!v)
		return NAT_GC_GONE;
	if (!cfg)
		return NAT_GC_KEPT;
	vl = nat_stamp(&v->last_seen_ns);
	flags = v->flags;
	o = NULL;
	if (k->dir != DIR_INBOUND) {
		FAM(nat_pair)(k, v, &peer);
		o = bpf_map_lookup_elem(&FAM(nat), &peer);
		/* the other half only if it points back at k */
		if (o && (k->dir == DIR_EGRESS ? !FAM_ADDR_EQ(o->addr, k->src) || o->port != k->sport :
						 !FAM_ADDR_EQ(o->addr, k->dst) || o->port != k->dport))
			o = NULL;
	}
	last = vl;
	if (o) {
		ol = nat_stamp(&o->last_seen_ns);
		flags |= o->flags;
		last = nat_later(ol, vl);
		if (bpf_map_lookup_elem(&FAM(nat), &peer) != o)
			o = NULL; /* reused by another key since: not k's other half */
	}
	/* Read after a concurrent delete, v may be another key's element (a
	 * preallocated map reuses it at once): claimed, it would stay claimed
	 * and k's new entry be deleted. The claim below fails if it changed
	 * after this check (its stamp moves). */
	if (bpf_map_lookup_elem(&FAM(nat), k) != v)
		return NAT_GC_KEPT;
	/* The pair's note (evict.h) is its reply entry's, cleared with it:
	 * the searches would otherwise meet it, and look it up. */
	created = v->created_ns;
	if (k->dir == DIR_EGRESS) {
		noted = &peer;
		if (o)
			created = o->created_ns;
	}
	if (last == NAT_CLAIMED)
		return NAT_GC_KEPT; /* another party is ending or rebuilding it */
	if (!force && !nat_expired(cfg, k->proto, flags, last, now))
		return NAT_GC_KEPT;
	if (!o) {
		if (k->dir == DIR_INGRESS && !force && nat_being_made(now, v->created_ns))
			return NAT_GC_KEPT;
		if (!nat_claim(&v->last_seen_ns, vl, NAT_CLAIMED))
			return NAT_GC_KEPT;
		FAM(nat_delete)(k);
		FAM(nat_cand_mark)(noted, created, 0);
		return NAT_GC_ENDED;
	}
	if (k->dir == DIR_INGRESS) {
		if (!nat_claim(&v->last_seen_ns, vl, NAT_CLAIMED))
			return NAT_GC_KEPT;
		FAM(nat_delete)(&peer);
		FAM(nat_delete)(k);
		FAM(nat_cand_mark)(noted, created, 0);
		return NAT_GC_ENDED;
	}
	if (!nat_claim(&o->last_seen_ns, ol, NAT_CLAIMED))
		return NAT_GC_KEPT;
	FAM(nat_delete)(k);
	FAM(nat_delete)(&peer);
	FAM(nat_cand_mark)(noted, created, 0);
	return NAT_GC_ENDED;
}

#undef FAMILY
#include "family.h"
