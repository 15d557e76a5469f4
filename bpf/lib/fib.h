/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The route lookup that picks a new flow's SNAT address (decision.h). */

#ifndef IPMASQ_LIB_FIB_H
#define IPMASQ_LIB_FIB_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "maps.h"

#define AF_INET_	2
#define AF_INET6_	10

static __always_inline struct bpf_fib_lookup *fib_params(struct __sk_buff *skb, __u8 family)
{
	__u32 zero = 0;
	struct bpf_fib_lookup *fib = (void *)bpf_map_lookup_elem(&fib_scratch, &zero);

	if (!fib)
		return NULL;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = family;
	fib->ifindex = skb->ifindex;
	return fib;
}

#define FIB_SOURCE_FLAGS (BPF_FIB_LOOKUP_OUTPUT | BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH)

#endif /* IPMASQ_LIB_FIB_H */
