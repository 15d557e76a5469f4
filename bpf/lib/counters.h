/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The per-CPU packet counters (read by the agent as bpf.Counters). */

#ifndef IPMASQ_LIB_COUNTERS_H
#define IPMASQ_LIB_COUNTERS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* Counters, indexed into the per-CPU array "counters". */
enum counter {
	COUNTER_MASQUERADED,		/* packets source-translated on egress */
	COUNTER_NAT_NEW,		/* new NAT pairs created */
	COUNTER_SKIP_NONMASQ_DST,	/* not masqueraded: destination is a non-masquerade CIDR */
	COUNTER_SKIP_NODE_DST,		/* not masqueraded: destination is a node address */
	COUNTER_SKIP_NOT_SOURCE,	/* not masqueraded: source is not a masquerade source */
	COUNTER_SKIP_NO_SNAT_ADDR,	/* not masqueraded: the device is not (yet) an egress device */
	COUNTER_DROP_UNTRANSLATABLE,	/* dropped: from a masquerade source to a masqueraded destination, cannot be translated (IPv6 extension header chain, fragmented ICMP error, echo reply of no flow) */
	COUNTER_REVERSE,		/* replies destination-translated on ingress */
	COUNTER_ICMP_ERR_REVERSE,	/* ICMP errors translated back to the pod on ingress */
	COUNTER_NAT_FULL,		/* dropped: NAT table full of assured pairs: the new flow is refused */
	COUNTER_NO_PORT,		/* dropped: no free NAT port */
	COUNTER_FRAGMENTS,		/* non-first fragments translated (either direction) */
	COUNTER_FRAG_UNKNOWN,		/* dropped: egress non-first fragment of a masqueraded flow without its first fragment */
	COUNTER_ERROR,			/* malformed packets and helper failures */
	COUNTER_NAT_NEW_BY_RULE,	/* new NAT pairs created for a masq_rules_* source (also in COUNTER_NAT_NEW) */
	COUNTER_INBOUND_NEW,		/* inbound flows to a masquerade source recorded (their replies are not translated) */
	COUNTER_SKIP_INBOUND_REPLY,	/* not masqueraded: a reply of an inbound flow */
	COUNTER_SKIP_NOT_FLOW_START,	/* not masqueraded: a node flow's packet, no NAT pair, and it does not start a flow (SYN-ACK, RST, mid-stream) */
	COUNTER_NAT_REOPENED,		/* a new SYN reopened a closed or expired pair */
	COUNTER_NAT_REUSED,		/* a NAT port taken over from an expired pair or a closed pair of the same source */
	COUNTER_DROP_NO_SNAT_ADDR,	/* dropped: to be masqueraded, but the device has no address of the family */
	COUNTER_ICMP_ERR_EGRESS,	/* ICMP errors about translated flows translated on egress (quote, and the source of a pod's error) */
	COUNTER_ICMP_ERR_UNMATCHED,	/* dropped: ICMP error from a masquerade source to a masqueraded destination about no translated flow */
	COUNTER_NAT_NEW_SCTP,		/* new SCTP pairs, port kept (also in COUNTER_NAT_NEW) */
	COUNTER_NAT_NEW_ADDR_ONLY,	/* new address-only pairs: GRE, ESP, other protocols (also in COUNTER_NAT_NEW) */
	COUNTER_PAIR_TAKEN,		/* dropped: another source holds the SCTP port or address-only pair to this remote */
	COUNTER_HOST_FLOW_NEW,		/* node flows whose tuple is held from NAT (a node socket's port in the NAT range) */
	COUNTER_NAT_PORT_KEPT,		/* new NAT pairs that kept the source's own port (also in COUNTER_NAT_NEW) */
	COUNTER_HOST_FLOW_REMAPPED,	/* node flows whose tuple a translated flow held: given a port of the NAT range */
	COUNTER_NAT_PICKED_UP,		/* new NAT pairs made by a mid-stream TCP segment without one (nf_conntrack_tcp_loose; also in COUNTER_NAT_NEW) */
	COUNTER_DROP_NO_PAIR,		/* dropped: a TCP RST or SYN-ACK from a masquerade source to a masqueraded destination, without a NAT pair */
	COUNTER_FORMER_SOURCE,		/* packets of a former masquerade source's NAT pair, translated until the flow ends (also in COUNTER_MASQUERADED) */
	COUNTER_NAT_EARLY_DROP,		/* pairs not assured (unanswered, closing, UDP queries) dropped to admit a new flow into a full NAT map */
	COUNTER_MAX,
};

/* Exported so that bpf2go emits the enum for Go (bpf.Counter). */
const volatile enum counter counter_max = COUNTER_MAX;

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, COUNTER_MAX);
} counters SEC(".maps");

static __always_inline void count(enum counter c)
{
	__u32 key = c;
	__u64 *v = bpf_map_lookup_elem(&counters, &key);

	if (v)
		*v += 1;
}

#endif /* IPMASQ_LIB_COUNTERS_H */
