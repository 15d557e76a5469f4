/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The collector's compare-and-delete: the agent's end of a NAT pair. */

#ifndef IPMASQ_LIB_NATGC_H
#define IPMASQ_LIB_NATGC_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "maps.h"
#include "flow.h"

/*
 * The agent's collector scans the NAT maps from user space, but does not
 * delete what it found expired by key: a SYN may reopen the pair, or a new
 * flow take its port over, between its read and its delete, and a delete by
 * key would then remove the new entries. It runs nat_gc_v4/v6 (a syscall
 * program, BPF_PROG_TEST_RUN) for each candidate instead, which judges the
 * pair again against its own clock under the programs' lifetimes, claims it
 * as the programs do (lib/flow.h, NAT_CLAIMED) and only then deletes both
 * halves: a pair reopened or taken over meanwhile is fresh or claimed by
 * its new owner, and kept. The pair's early-drop note goes with it
 * (lib/evict.h), so that no search meets it and looks it up.
 */

/* nat_gc_*_ctx.result */
enum nat_gc_result {
	NAT_GC_KEPT,	/* not expired (or claimed by another party): kept */
	NAT_GC_ENDED,	/* the pair (or inbound record) deleted, both halves */
	NAT_GC_GONE,	/* no entry at the key */
};

/* Exported so that bpf2go emits the enum for Go. */
const volatile enum nat_gc_result nat_gc_result_last = NAT_GC_GONE;

/* The context of nat_gc_v4: key is either half of a pair, or an inbound
 * record; force ends it whatever its age (its SNAT address is gone). */
struct nat_gc_v4_ctx {
	struct nat_v4_key key;
	__u32 force;
	__u32 result;	/* out: enum nat_gc_result */
};

struct nat_gc_v6_ctx {
	struct nat_v6_key key;
	__u32 force;
	__u32 result;
};

#define FAMILY 4
#include "natgc_fam.h"
#define FAMILY 6
#include "natgc_fam.h"

#endif /* IPMASQ_LIB_NATGC_H */
