/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Handing established flows between Linux conntrack and the NAT pairs. */

#ifndef IPMASQ_LIB_HANDOVER_H
#define IPMASQ_LIB_HANDOVER_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "maps.h"
#include "flow.h"
#include "natcount.h"
#include "parse.h"

/*
 * A node that moves from a netfilter MASQUERADE agent to ipmasq (or back)
 * has flows translated by conntrack that must keep their translation
 * across the move (docs/migrate.md). The agent moves them one at a time:
 *
 *   - adopt: a conntrack binding (pod:port -> remote, translated to
 *     node:P) becomes a NAT pair with the same P, made by nat_handover_*
 *     below, before the netfilter rule that made it goes. Removing the last
 *     MASQUERADE rule of a namespace flushes conntrack's masqueraded
 *     entries; the pod's next packet then reaches the egress program
 *     untranslated and finds the pair.
 *   - hand back: a pair is given to conntrack (the agent creates a
 *     conntrack entry with the pair's translation over ctnetlink) before
 *     ipmasq goes; the pod's packets are then translated by netfilter
 *     before the egress program sees them.
 *
 * Both leave a pair whose translation conntrack may hold (its reply entry
 * marked NAT_HANDOVER_CONNTRACK). The egress program needs nothing: a
 * packet conntrack translated reaches it with the node's address. The
 * ingress program runs before conntrack, and must not translate a reply
 * conntrack will translate (conntrack would see a second flow whose reply
 * tuple clashes with its own, and drop it): for such a pair it asks
 * conntrack first (bpf_skb_ct_lookup with the tuple as it arrived) and
 * leaves the packet to conntrack when it has an entry. Only marked pairs
 * pay the lookup. On a kernel without the conntrack kfuncs (or without
 * nf_conntrack loaded when the datapath loaded) the lookup is absent
 * (conntrack_lookup 0) and the agent moves no flow.
 */

/* The kfuncs' options (struct bpf_ct_opts): the first 12 bytes, the size
 * every kernel with the kfuncs (5.18 on) accepts. */
struct bpf_ct_opts___ipmasq {
	__s32 netns_id;
	__s32 error;
	__u8 l4proto;
	__u8 dir;
	__u8 reserved[2];
};

enum {
	CT_OPTS_SZ = 12,
	CT_NETNS_CURRENT = -1,	/* BPF_F_CURRENT_NETNS */
};

/* conntrack's entry: opaque here, but a struct (not a declaration) for
 * the loader's check of the kfuncs' types against the kernel's. */
struct nf_conn {
	__u64 opaque;
};

extern struct nf_conn *bpf_skb_ct_lookup(struct __sk_buff *skb, struct bpf_sock_tuple *tuple, __u32 tuple_sz,
					 struct bpf_ct_opts___ipmasq *opts, __u32 opts_sz) __ksym __weak;
extern void bpf_ct_release(struct nf_conn *ct) __ksym __weak;

/* Whether the kernel has the kfuncs above, set by the loader (Go:
 * bpf.ConntrackLookupAvailable) before the programs load. A constant, so
 * that the verifier drops the calls where they are absent: testing the
 * weak symbols' addresses instead (libbpf's bpf_ksym_exists) needs a kernel
 * that takes ld_imm64 of a kfunc (6.4), and the object loads from 5.11. */
const volatile __u32 conntrack_lookup = 0;

/* nat_handover_*_ctx.op */
enum nat_handover_op {
	NAT_HANDOVER_ADOPT,	/* make the pair key -> addr:port, marked */
	NAT_HANDOVER_MARK,	/* mark the existing pair of key */
};

/* nat_handover_*_ctx.result */
enum nat_handover_result {
	NAT_HANDOVER_DONE,	/* made (ADOPT) or marked (MARK) */
	NAT_HANDOVER_EXISTS,	/* ADOPT: key already has a pair (kept) */
	NAT_HANDOVER_TAKEN,	/* ADOPT: addr:port toward the remote is claimed by another party */
	NAT_HANDOVER_GONE,	/* MARK: key has no whole pair */
	NAT_HANDOVER_FULL,	/* ADOPT: the map is full */
};

/* Exported so that bpf2go emits the enums for Go. */
const volatile enum nat_handover_op nat_handover_op_last = NAT_HANDOVER_MARK;
const volatile enum nat_handover_result nat_handover_result_last = NAT_HANDOVER_FULL;

/* The context of nat_handover_v4: key is the flow's egress tuple (dir 0),
 * addr and port (network byte order) its translation; seen: the remote has
 * answered (TCP: established). */
struct nat_handover_v4_ctx {
	struct nat_v4_key key;
	__be32 addr;
	__be16 port;
	__u8 op;	/* enum nat_handover_op */
	__u8 seen;
	__u32 result;	/* out: enum nat_handover_result */
};

struct nat_handover_v6_ctx {
	struct nat_v6_key key;
	__u8 addr[16];
	__be16 port;
	__u8 op;
	__u8 seen;
	__u32 result;
};

#define FAMILY 4
#include "handover_fam.h"
#define FAMILY 6
#include "handover_fam.h"

#endif /* IPMASQ_LIB_HANDOVER_H */
