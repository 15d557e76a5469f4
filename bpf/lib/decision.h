/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Whether a new flow is masqueraded, and to which address. */

#ifndef IPMASQ_LIB_DECISION_H
#define IPMASQ_LIB_DECISION_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"

static __always_inline int is_masq_source_v4(__be32 src)
{
	struct lpm_v4_key k = { .prefixlen = 32 };
	__u8 *v;

	__builtin_memcpy(k.addr, &src, 4);
	v = bpf_map_lookup_elem(&masq_src_v4, &k);
	return v && *v == 1;
}

static __always_inline int is_masq_source_v6(const __u8 *src)
{
	struct lpm_v6_key k = { .prefixlen = 128 };
	__u8 *v;

	__builtin_memcpy(k.addr, src, 16);
	v = bpf_map_lookup_elem(&masq_src_v6, &k);
	return v && *v == 1;
}

/*
 * masq_source_v4/v6 say whether a packet from src leaving through the skb's
 * device is a masquerade candidate: a pod source (masq_src_*, *rule = NULL)
 * or a source with a user rule for this device (*rule = its masq_rules_*
 * entry). Pod sources take one lookup as before; only the others, mostly
 * the host's own traffic, pay for the rule lookup too.
 *
 * The check runs before the NAT lookup of established flows, so that host
 * traffic never pays for one: removing a rule (like removing a pod CIDR)
 * stops translating its flows at once, and their NAT pairs stay until the
 * collector expires them. What decide_* looks at (destination, the rule's
 * toAddress, the device's address) only matters when a flow starts: an
 * established flow keeps the SNAT address it started with.
 */
static __always_inline int masq_source_v4(struct __sk_buff *skb, __be32 src,
					  const struct masq_rule **rule)
{
	struct masq_rule_v4_key k = { .prefixlen = 64, .ifindex = skb->ifindex };

	*rule = NULL;
	if (is_masq_source_v4(src))
		return 1;
	__builtin_memcpy(k.addr, &src, 4);
	*rule = bpf_map_lookup_elem(&masq_rules_v4, &k);
	return *rule != NULL;
}

static __always_inline int masq_source_v6(struct __sk_buff *skb, const __u8 *src,
					  const struct masq_rule **rule)
{
	struct masq_rule_v6_key k = { .prefixlen = 160, .ifindex = skb->ifindex };

	*rule = NULL;
	if (is_masq_source_v6(src))
		return 1;
	__builtin_memcpy(k.addr, src, 16);
	*rule = bpf_map_lookup_elem(&masq_rules_v6, &k);
	return *rule != NULL;
}

/*
 * The SNAT address of a new flow is the kernel's own source selection for
 * the route the packet takes through this device (bpf_fib_lookup with
 * BPF_FIB_LOOKUP_SRC, from the source's point of view so ip rules apply):
 * the route's preferred source, else the device's address that fits the
 * next hop (IPv4) or RFC 6724's choice (IPv6), exactly what MASQUERADE
 * asks the kernel for. The pair keeps it for the flow's life. When the
 * lookup finds no route through the device, the device's primary address
 * (egress_devs) is used.
 */

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

/* fib_source_v4 returns 1 with *snat set, 0 when the kernel has no route
 * through this device, -1 when it has one but no source address for it. */
static __always_inline int fib_source_v4(struct __sk_buff *skb, __be32 src, __be32 dst, __be32 *snat)
{
	struct bpf_fib_lookup *fib = fib_params(skb, AF_INET_);
	long ret;

	if (!fib)
		return 0;
	fib->ipv4_src = src;
	fib->ipv4_dst = dst;
	ret = bpf_fib_lookup(skb, fib, sizeof(*fib), FIB_SOURCE_FLAGS);
	if (ret == BPF_FIB_LKUP_RET_SUCCESS && fib->ifindex == skb->ifindex && fib->ipv4_src) {
		*snat = fib->ipv4_src;
		return 1;
	}
	return ret == BPF_FIB_LKUP_RET_NO_SRC_ADDR ? -1 : 0;
}

static __always_inline int fib_source_v6(struct __sk_buff *skb, const struct pkt *p, __u8 *snat)
{
	struct bpf_fib_lookup *fib = fib_params(skb, AF_INET6_);
	long ret;

	if (!fib)
		return 0;
	__builtin_memcpy(fib->ipv6_src, p->v6.saddr, 16);
	__builtin_memcpy(fib->ipv6_dst, p->v6.daddr, 16);
	ret = bpf_fib_lookup(skb, fib, sizeof(*fib), FIB_SOURCE_FLAGS);
	if (ret == BPF_FIB_LKUP_RET_SUCCESS && fib->ifindex == skb->ifindex) {
		__builtin_memcpy(snat, fib->ipv6_src, 16);
		return 1;
	}
	return ret == BPF_FIB_LKUP_RET_NO_SRC_ADDR ? -1 : 0;
}

/* decide_v4 returns COUNTER_MASQUERADED with the SNAT address, or the counter
 * that says why the packet is left alone. The source was checked already by
 * masq_source_v4, which found rule (NULL for a pod source). The device must
 * be an egress device even when the rule names its own address: the agent
 * writes an entry for every device it attached, with or without addresses. */
static __always_inline enum counter decide_v4(struct __sk_buff *skb, __be32 src, __be32 dst,
					      const struct masq_rule *rule, __be32 *snat)
{
	struct lpm_v4_key k = { .prefixlen = 32 };
	struct egress_dev *dev;
	__u32 ifindex = skb->ifindex;
	__u8 *action;

	if (bpf_map_lookup_elem(&node_addrs_v4, &dst))
		return COUNTER_SKIP_NODE_DST;
	__builtin_memcpy(k.addr, &dst, 4);
	/* Longest prefix wins: a masqueradeCIDRs entry (action 1) inside a
	 * non-masquerade range is masqueraded. */
	action = bpf_map_lookup_elem(&nonmasq_v4, &k);
	if (action && *action == 0)
		return COUNTER_SKIP_NONMASQ_DST;
	dev = bpf_map_lookup_elem(&egress_devs, &ifindex);
	if (!dev)
		return COUNTER_SKIP_NO_SNAT_ADDR;
	if (rule && rule->has_to) {
		*snat = rule->to_v4;
		return COUNTER_MASQUERADED;
	}
	switch (fib_source_v4(skb, src, dst, snat)) {
	case 1:
		return COUNTER_MASQUERADED;
	case -1:
		return COUNTER_DROP_NO_SNAT_ADDR;
	}
	if (!dev->has_v4)
		return COUNTER_DROP_NO_SNAT_ADDR;
	*snat = dev->snat_v4;
	return COUNTER_MASQUERADED;
}

/* decide_v6 is decide_v4 for IPv6. */
static __always_inline enum counter decide_v6(struct __sk_buff *skb, const struct pkt *p,
					      const struct masq_rule *rule, __u8 *snat)
{
	const __u8 *dst = p->v6.daddr;
	struct lpm_v6_key k = { .prefixlen = 128 };
	struct egress_dev *dev;
	__u32 ifindex = skb->ifindex;
	__u8 *action;

	__builtin_memcpy(k.addr, dst, 16);
	if (bpf_map_lookup_elem(&node_addrs_v6, k.addr))
		return COUNTER_SKIP_NODE_DST;
	action = bpf_map_lookup_elem(&nonmasq_v6, &k);
	if (action && *action == 0)
		return COUNTER_SKIP_NONMASQ_DST;
	dev = bpf_map_lookup_elem(&egress_devs, &ifindex);
	if (!dev)
		return COUNTER_SKIP_NO_SNAT_ADDR;
	if (rule && rule->has_to) {
		__builtin_memcpy(snat, rule->to_v6, 16);
		return COUNTER_MASQUERADED;
	}
	switch (fib_source_v6(skb, p, snat)) {
	case 1:
		return COUNTER_MASQUERADED;
	case -1:
		return COUNTER_DROP_NO_SNAT_ADDR;
	}
	if (!dev->has_v6)
		return COUNTER_DROP_NO_SNAT_ADDR;
	__builtin_memcpy(snat, dev->snat_v6, 16);
	return COUNTER_MASQUERADED;
}

#endif /* IPMASQ_LIB_DECISION_H */
