/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The decision of decision.h for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers
 * it uses.
 */

#include "family.h"

/* masq_src_flags_v4/v6 return the masq_src_* flags of src (0: no entry). */
static __always_inline __u8 FAM(masq_src_flags)(const FAM_ADDR src)
{
	FAM_T(lpm, key) k = { .prefixlen = FAM_ADDR_BITS };
	__u8 *v;

	__builtin_memcpy(k.addr, FAM_PTR(src), FAM_ADDR_LEN);
	v = bpf_map_lookup_elem(&FAM(masq_src), &k);
	return v ? *v : 0;
}

/*
 * masq_source_v4/v6 say whether a packet from src leaving through the skb's
 * device is a masquerade candidate: a masquerade source (masq_src_*, *rule =
 * NULL) or a source with a user rule for this device (*rule = its
 * masq_rules_* entry). A source no rule names (pods, the node's own
 * addresses) takes one lookup; only a rule's sources pay for the rule
 * lookup too, which comes first so that the rule's toAddress applies.
 *
 * The check runs before the NAT lookup of established flows, so that host
 * traffic never pays for one: removing a rule (like removing a pod CIDR)
 * stops translating its flows at once, and their NAT pairs stay until the
 * collector expires them. What decide_* looks at (destination, the rule's
 * toAddress, the device's address) only matters when a flow starts: an
 * established flow keeps the SNAT address it started with.
 */
static __always_inline int FAM(masq_source)(struct __sk_buff *skb, const FAM_ADDR src,
					    const struct masq_rule **rule)
{
	/* the 32 ifindex bits always match in full */
	FAM_T(masq_rule, key) k = { .prefixlen = 32 + FAM_ADDR_BITS, .ifindex = skb->ifindex };
	__u8 flags = FAM(masq_src_flags)(src);

	*rule = NULL;
	if (flags & MASQ_SRC_RULES) {
		__builtin_memcpy(k.addr, FAM_PTR(src), FAM_ADDR_LEN);
		*rule = bpf_map_lookup_elem(&FAM(masq_rules), &k);
		if (*rule)
			return 1;
	}
	return (flags & MASQ_SRC_MASQUERADE) != 0;
}

/* fib_source_v4/v6 return 1 with *snat set, 0 when the kernel has no route
 * through this device, -1 when it has one but no source address for it. */
static __always_inline int FAM(fib_source)(struct __sk_buff *skb, const struct pkt *p,
					   FAM_ADDR *snat)
{
	struct bpf_fib_lookup *fib = fib_params(skb, FAM_AF);
	long ret;

	if (!fib)
		return 0;
	FAM_ADDR_COPY(fib->FAM_FIB(src), FAM_PKT(p).saddr);
	FAM_ADDR_COPY(fib->FAM_FIB(dst), FAM_PKT(p).daddr);
	ret = bpf_fib_lookup(skb, fib, sizeof(*fib), FIB_SOURCE_FLAGS);
	if (ret == BPF_FIB_LKUP_RET_SUCCESS && fib->ifindex == skb->ifindex &&
	    (FAM_IS_V6 || fib->ipv4_src)) {
		FAM_ADDR_COPY(*snat, fib->FAM_FIB(src));
		return 1;
	}
	return ret == BPF_FIB_LKUP_RET_NO_SRC_ADDR ? -1 : 0;
}

/* decide_v4/v6 return COUNTER_MASQUERADED with the SNAT address in *snat, or
 * the counter that says why the packet is left alone. The source was checked
 * already by masq_source_*, which found rule (NULL for a pod source). The
 * device must be an egress device even when the rule names its own address:
 * the agent writes an entry for every device it attached, with or without
 * addresses. */
static __always_inline enum counter FAM(decide)(struct __sk_buff *skb, const struct pkt *p,
						const struct masq_rule *rule, FAM_ADDR *snat)
{
	FAM_T(lpm, key) k = { .prefixlen = FAM_ADDR_BITS };
	struct egress_dev *dev;
	__u32 ifindex = skb->ifindex;
	__u8 *action;

	__builtin_memcpy(k.addr, FAM_PTR(FAM_PKT(p).daddr), FAM_ADDR_LEN);
	if (bpf_map_lookup_elem(&FAM(node_addrs), k.addr))
		return COUNTER_SKIP_NODE_DST;
	/* Longest prefix wins: a masqueradeCIDRs entry (action 1) inside a
	 * non-masquerade range is masqueraded. */
	action = bpf_map_lookup_elem(&FAM(nonmasq), &k);
	if (action && *action == 0)
		return COUNTER_SKIP_NONMASQ_DST;
	dev = bpf_map_lookup_elem(&egress_devs, &ifindex);
	if (!dev)
		return COUNTER_SKIP_NO_SNAT_ADDR;
	if (rule && rule->has_to) {
		FAM_ADDR_COPY(*snat, rule->FAM(to));
		return COUNTER_MASQUERADED;
	}
	switch (FAM(fib_source)(skb, p, snat)) {
	case 1:
		return COUNTER_MASQUERADED;
	case -1:
		return COUNTER_DROP_NO_SNAT_ADDR;
	}
	if (!dev->FAM(has))
		return COUNTER_DROP_NO_SNAT_ADDR;
	FAM_ADDR_COPY(*snat, dev->FAM(snat));
	return COUNTER_MASQUERADED;
}

#undef FAMILY
#include "family.h"
