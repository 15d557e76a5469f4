/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The records of unmasq.h for one family: a template, included once with
 * FAMILY 4 and once with FAMILY 6 (see family.h), after the headers it
 * uses.
 *
 * Defines: unmasq_kept_v4, unmasq_kept_v6, unmasq_record_v4,
 * unmasq_record_v6.
 */

#include "family.h"

/* unmasq_kept_v4/v6 say whether the egress tuple k (a masquerade source's
 * packet p without a NAT pair) belongs to a flow that started unmasqueraded
 * and still lives: its packet passes as it is. The record is refreshed at
 * most once a second, or at once for a new FIN or RST. A stale record is
 * deleted, so that it can never let a later flow of the tuple out
 * untranslated. Records take no claims: two CPUs racing on one only decide
 * the flow again. */
static __noinline int FAM(unmasq_kept)(const FAM_T(nat, key) *k, const struct pkt *p)
{
	struct masq_config *cfg;
	struct unmasq_val *u;
	__u64 now, last;
	__u8 flags;

	if (!k || !p)
		return 0;
	u = bpf_map_lookup_elem(&FAM(unmasq), k);
	if (!u)
		return 0;
	now = unmasq_now();
	last = u->last_seen_ns;
	flags = unmasq_flags(p);
	/* Most packets: stamped within the last second (every lifetime is
	 * longer; a pair's packets make the same bet, nat_established_*) and
	 * nothing new to note. */
	if (!(flags & ~u->flags) && !tcp_syn(p) && nat_age(now, last) <= (__s64)NAT_REFRESH_NS)
		return 1;
	cfg = masq_cfg();
	if (!cfg || nat_expired(cfg, k->proto, u->flags, last, now) ||
	    (tcp_syn(p) && (u->flags & (NAT_F_FIN | NAT_F_RST)))) {
		bpf_map_delete_elem(&FAM(unmasq), k);
		return 0;
	}
	u->flags |= flags;
	u->last_seen_ns = now;
	return 1;
}

/* unmasq_record_v4/v6 record the flow of egress tuple k, whose packet p
 * starts it (or picks it up) and was left unmasqueraded. A failed insert
 * leaves the flow to be decided by each packet, as before records. */
static __noinline void FAM(unmasq_record)(const FAM_T(nat, key) *k, const struct pkt *p)
{
	struct unmasq_val u = {};

	if (!k || !p)
		return;
	u.last_seen_ns = unmasq_now();
	u.flags = unmasq_flags(p);
	if (bpf_map_update_elem(&FAM(unmasq), k, &u, BPF_ANY) == 0)
		count(COUNTER_UNMASQ_NEW);
}

#undef FAMILY
#include "family.h"
