/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Fragments: the translation of a datagram's non-first fragments. */

#ifndef IPMASQ_LIB_FRAG_H
#define IPMASQ_LIB_FRAG_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "maps.h"
#include "parse.h"

/*
 * Fragments (IPv4 MF/offset, IPv6 fragment header): the first fragment holds
 * the L4 header and is translated like any packet of its flow, ports and L4
 * checksum included (the checksum covers the whole datagram, and the update
 * is a delta). It also records (src, dst, id, proto, dir) -> translated
 * address in frag_v4/frag_v6, and the later fragments get the L3 rewrite
 * only. A later fragment with no record (reordered before its first, or the
 * record evicted) is dropped on egress when its flow would be masqueraded,
 * so the pod address never leaves, and passed untouched on ingress.
 */

static __always_inline void frag_remember_v4(const struct pkt *p, int dir, __be32 to)
{
	struct frag_v4_key k = {
		.src = p->v4.saddr, .dst = p->v4.daddr, .id = p->frag_id,
		.proto = p->proto, .dir = dir,
	};
	struct frag_v4_val v = { .addr = to };

	bpf_map_update_elem(&frag_v4, &k, &v, BPF_ANY);
}

static __always_inline void frag_remember_v6(const struct pkt *p, int dir, const __u8 *to)
{
	struct frag_v6_key k = { .id = p->frag_id, .proto = p->proto, .dir = dir };
	struct frag_v6_val v;

	__builtin_memcpy(k.src, p->v6.saddr, 16);
	__builtin_memcpy(k.dst, p->v6.daddr, 16);
	__builtin_memcpy(v.addr, to, 16);
	bpf_map_update_elem(&frag_v6, &k, &v, BPF_ANY);
}

static __always_inline struct frag_v4_val *frag_lookup_v4(const struct pkt *p, int dir)
{
	struct frag_v4_key k = {
		.src = p->v4.saddr, .dst = p->v4.daddr, .id = p->frag_id,
		.proto = p->proto, .dir = dir,
	};

	return bpf_map_lookup_elem(&frag_v4, &k);
}

static __always_inline struct frag_v6_val *frag_lookup_v6(const struct pkt *p, int dir)
{
	struct frag_v6_key k = { .id = p->frag_id, .proto = p->proto, .dir = dir };

	__builtin_memcpy(k.src, p->v6.saddr, 16);
	__builtin_memcpy(k.dst, p->v6.daddr, 16);
	return bpf_map_lookup_elem(&frag_v6, &k);
}

#endif /* IPMASQ_LIB_FRAG_H */
