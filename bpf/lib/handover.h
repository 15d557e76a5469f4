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
 *     below, before the netfilter rule that made it goes. Conntrack keeps
 *     translating the flows it has after the rule goes (removing it
 *     flushes nothing: checked on 6.1 and 6.18); once conntrack loses a
 *     flow (its entry expires or is deleted, or conntrack stops tracking
 *     the namespace), the pod's next packet reaches the egress program
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

/*
 * The hand-back's races. The agent replaces conntrack's untranslated
 * entry of a flow by a translating one with a delete and a create
 * (ctnetlink cannot add a translation to an entry). Between the two,
 * conntrack has no entry of the flow, and a packet of it that reaches
 * conntrack makes one of its own:
 *
 *   - the pod's segment: the netfilter rule translates it with a port of
 *     its choice (random with --random-fully), so it would leave from
 *     another port, and a TCP remote answers it with a reset that
 *     conntrack brings back to the pod;
 *   - the remote's segment, translated to the pod here: its entry's
 *     reply tuple is the flow's own, which the agent's entry takes a
 *     moment later, so conntrack gives it another source port (its clash
 *     remap) and the pod answers that unknown port with a reset.
 *
 * While it hands a flow back, the agent names it in handback_v4/v6, by
 * its remote, with its pair's port. The egress program drops a
 * node-sourced TCP segment to that remote whose conntrack entry is the
 * pod's flow's and whose port is not the pair's (handback_stray_v4/v6);
 * the agent finds that stray entry when its create fails, and replaces
 * it. The ingress program drops the named flow's TCP segments while
 * conntrack has no translating entry for them (handback_window_v4/v6).
 * Each sender retransmits. Outside a hand-back (handback_active 0) a
 * node's segment pays one array read for this (inlined, handback_on), not
 * a call nor the notes' hash lookup, and a reply pays nothing unless its
 * pair is conntrack's and conntrack has no entry for it.
 */
struct handback_v4_key {
	__be32 remote;
	__be16 rport;
	__u8 proto;
	__u8 pad;
};

/* The flow's source (the pod's address and port) and the port its pair
 * translates it to. */
struct handback_v4_val {
	__be32 src;
	__be16 sport;
	__be16 port;
};

struct handback_v6_key {
	__u8 remote[16];
	__be16 rport;
	__u8 proto;
	__u8 pad;
};

struct handback_v6_val {
	__u8 src[16];
	__be16 sport;
	__be16 port;
};

/* Written by the agent only: a few flows at a time (it hands back one
 * after another, and empties the map after each pass). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct handback_v4_key);
	__type(value, struct handback_v4_val);
	__uint(max_entries, 64);
} handback_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct handback_v6_key);
	__type(value, struct handback_v6_val);
	__uint(max_entries, 64);
} handback_v6 SEC(".maps");

/* Non-zero while the agent hands flows back (its notes may be in
 * handback_v4/v6). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 1);
} handback_active SEC(".maps");

/* handback_active's key, a read-only global: a key on the stack would
 * add to the frame of the egress program, whose stack is near the limit
 * (bpf/stack_test.go), and a constant key costs no store. */
const volatile __u32 handback_key = 0;

/* handback_on says whether a hand-back is under way: a read of an array
 * the JIT inlines (no call), made by the programs themselves before they
 * call handback_stray_v4/v6 or handback_window_v4/v6, so that outside a
 * hand-back a packet pays one load and a branch for it. An array pinned
 * with the other maps, not a global variable: a program of an earlier
 * load still attached (a replace under way) reads the same word. */
static __always_inline int handback_on(void)
{
	__u32 *on;

	if (!conntrack_lookup)
		return 0;
	on = bpf_map_lookup_elem(&handback_active, (const void *)&handback_key);
	return on && *on;
}

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
