/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The NAT maps' entry counts, kept by the programs as conntrack keeps
 * nf_conntrack_count: read by summing, at the same cost at any size. */

#ifndef IPMASQ_LIB_NATCOUNT_H
#define IPMASQ_LIB_NATCOUNT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "maps.h"

/*
 * Every insert into and delete from nat_v4/v6 goes through nat_insert_*,
 * nat_replace_* and nat_delete_*, which count the entry by class, per CPU:
 * +1 when an insert made a new entry (BPF_NOEXIST returned 0), -1 when a
 * delete removed one (it returned 0). Of two CPUs inserting or deleting one
 * key only one gets 0, so the count stays exact under races, early drop and
 * the collector. An entry's class is fixed by its key's direction, and for
 * a reply entry by NAT_F_HOST, which only a replacement of a claimed entry
 * (its claimer's alone, lib/flow.h) changes: nat_replace counts it out of
 * its old class and into its new one. A CPU's counter may go below zero
 * (made on one CPU, deleted on another): the sum over CPUs, mod 2^64, is
 * the count.
 */

/* nat_count index: family * NAT_CLASS_MAX + class. */
enum nat_class {
	NAT_CLASS_EGRESS,	/* dir 0: a translated flow's egress entry (a masquerade pair) */
	NAT_CLASS_REPLY,	/* dir 1 without NAT_F_HOST: a translated flow's reply entry */
	NAT_CLASS_INBOUND,	/* dir 2: an inbound flow record */
	NAT_CLASS_HOST,		/* dir 1 with NAT_F_HOST: a node flow's held tuple */
	NAT_CLASS_MAX,
};

/* Exported so that bpf2go emits the enum for Go. */
const volatile enum nat_class nat_class_max = NAT_CLASS_MAX;

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 2 * NAT_CLASS_MAX);
} nat_count SEC(".maps");

/* nat_count_add adds d to the family's (0: IPv4, 1: IPv6) count of class c.
 * Atomic although per CPU: a tc program may interrupt the collector's
 * syscall program on the same CPU. */
static __always_inline void nat_count_add(__u32 family, __u32 c, __s64 d)
{
	__u32 i = family * NAT_CLASS_MAX + c;
	__u64 *n;

	if (c >= NAT_CLASS_MAX)
		return;
	n = bpf_map_lookup_elem(&nat_count, &i);
	if (n)
		__sync_fetch_and_add(n, (__u64)d);
}

/* nat_class_of is the class of an entry of direction dir with flags. */
static __always_inline __u32 nat_class_of(__u8 dir, __u8 flags)
{
	switch (dir) {
	case DIR_EGRESS:
		return NAT_CLASS_EGRESS;
	case DIR_INGRESS:
		return flags & NAT_F_HOST ? NAT_CLASS_HOST : NAT_CLASS_REPLY;
	}
	return NAT_CLASS_INBOUND;
}

#define FAMILY 4
#include "natcount_fam.h"
#define FAMILY 6
#include "natcount_fam.h"

#endif /* IPMASQ_LIB_NATCOUNT_H */
