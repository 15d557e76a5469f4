/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The per-CPU packet counters: the detailed global ones (bpf.Counter) and
 * the per-device outcome of every packet (bpf.DevCounters). */

#ifndef IPMASQ_LIB_COUNTERS_H
#define IPMASQ_LIB_COUNTERS_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

/* Counters, indexed into the per-CPU array "counters". */
enum counter {
	COUNTER_MASQUERADED,		/* packets source-translated on egress */
	COUNTER_NAT_NEW,		/* new NAT pairs created */
	COUNTER_SKIP_NONMASQ_DST,	/* not masqueraded: destination was a non-masquerade CIDR when the flow started */
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
	COUNTER_DROP_PAIR_CLAIMED,	/* dropped: a packet whose pair (or inbound record) another CPU, early drop or the collector was ending or reopening at that instant: a reopening SYN (the client retransmits), a reply */
	COUNTER_UNMASQ_NEW,		/* flows from a masquerade source left unmasqueraded (non-masquerade destination) and recorded: the decision is kept for the flow's life (unmasq_v4/v6) */
	COUNTER_TCP_RST_IGNORED,	/* TCP RSTs (either side) that did not end an established pair: their sequence number is not one the receiver expects (a blind RST); translated and delivered, the pair kept */
	COUNTER_DROP_HANDBACK,		/* dropped: a TCP segment of a pair being handed back to conntrack that conntrack gave another port in that instant (the sender retransmits it) */
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

/*
 * Per device, family and direction, every packet a program saw ends in one
 * action (the sum of the actions is every packet), and every dropped packet
 * has one reason. The programs' code says what happened through count();
 * the entry programs bracket each run with packet_begin() and packet_done(),
 * which adds the packet to its device's counters from its verdict and what
 * count() noted on the way (a per-CPU scratch: a program run is never
 * interrupted by another on the same CPU).
 */
enum action {
	ACTION_PASSED,		/* left as it was (not ours to translate, or no change needed) */
	ACTION_TRANSLATED,	/* source (egress) or destination (ingress) rewritten */
	ACTION_DROPPED,		/* TC_ACT_SHOT */
	ACTION_MAX,
};

/* Why a packet was dropped: the last drop counter noted before the verdict. */
enum drop_reason {
	DROP_OTHER,
	DROP_UNTRANSLATABLE,	/* COUNTER_DROP_UNTRANSLATABLE */
	DROP_NAT_FULL,		/* COUNTER_NAT_FULL */
	DROP_NO_PORT,		/* COUNTER_NO_PORT */
	DROP_FRAG_UNKNOWN,	/* COUNTER_FRAG_UNKNOWN */
	DROP_NO_SNAT_ADDR,	/* COUNTER_DROP_NO_SNAT_ADDR */
	DROP_ICMP_ERR_UNMATCHED, /* COUNTER_ICMP_ERR_UNMATCHED */
	DROP_PAIR_TAKEN,	/* COUNTER_PAIR_TAKEN */
	DROP_ERROR,		/* COUNTER_ERROR: malformed packet or helper failure */
	DROP_NO_PAIR,		/* COUNTER_DROP_NO_PAIR */
	DROP_PAIR_CLAIMED,	/* COUNTER_DROP_PAIR_CLAIMED */
	DROP_HANDBACK,		/* COUNTER_DROP_HANDBACK */
	DROP_REASON_MAX,
};

/* dev_counter_key.family */
enum counter_family {
	FAMILY_IPV4,
	FAMILY_IPV6,
	FAMILY_OTHER,		/* ARP and anything else the programs let pass */
};

struct dev_counter_key {
	__u32 ifindex;
	__u8 family;		/* enum counter_family */
	__u8 dir;		/* 0 egress, 1 ingress */
	__u8 pad[2];
};

struct dev_counter_val {
	__u64 packets[ACTION_MAX];
	__u64 drops[DROP_REASON_MAX];
};

/* Pinned like the NAT maps, so the counters survive agent restarts. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__type(key, struct dev_counter_key);
	__type(value, struct dev_counter_val);
	__uint(max_entries, 4096);
} dev_counters SEC(".maps");

/* What count() noted about the packet in flight. */
struct pkt_outcome {
	__u8 translated;
	__u8 reason;		/* enum drop_reason */
	__u8 pad[6];
	struct dev_counter_val zero; /* never written: a new device's first value */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct pkt_outcome);
	__uint(max_entries, 1);
} pkt_outcome SEC(".maps");

/* Exported so that bpf2go emits the enums for Go. */
const volatile enum action action_max = ACTION_MAX;
const volatile enum drop_reason drop_reason_max = DROP_REASON_MAX;
const volatile enum counter_family counter_family_other = FAMILY_OTHER;

static __always_inline struct pkt_outcome *outcome(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&pkt_outcome, &zero);
}

static __always_inline void note(enum counter c)
{
	struct pkt_outcome *o = outcome();
	__u8 reason = DROP_OTHER;

	if (!o)
		return;
	switch (c) {
	case COUNTER_MASQUERADED:
	case COUNTER_REVERSE:
	case COUNTER_ICMP_ERR_REVERSE:
	case COUNTER_ICMP_ERR_EGRESS:
	case COUNTER_FRAGMENTS:
		o->translated = 1;
		return;
	case COUNTER_DROP_UNTRANSLATABLE:
		reason = DROP_UNTRANSLATABLE;
		break;
	case COUNTER_NAT_FULL:
		reason = DROP_NAT_FULL;
		break;
	case COUNTER_NO_PORT:
		reason = DROP_NO_PORT;
		break;
	case COUNTER_FRAG_UNKNOWN:
		reason = DROP_FRAG_UNKNOWN;
		break;
	case COUNTER_DROP_NO_SNAT_ADDR:
		reason = DROP_NO_SNAT_ADDR;
		break;
	case COUNTER_ICMP_ERR_UNMATCHED:
		reason = DROP_ICMP_ERR_UNMATCHED;
		break;
	case COUNTER_PAIR_TAKEN:
		reason = DROP_PAIR_TAKEN;
		break;
	case COUNTER_ERROR:
		reason = DROP_ERROR;
		break;
	case COUNTER_DROP_NO_PAIR:
		reason = DROP_NO_PAIR;
		break;
	case COUNTER_DROP_PAIR_CLAIMED:
		reason = DROP_PAIR_CLAIMED;
		break;
	case COUNTER_DROP_HANDBACK:
		reason = DROP_HANDBACK;
		break;
	default:
		return;
	}
	o->reason = reason;
}

static __always_inline void count(enum counter c)
{
	__u32 key = c;
	__u64 *v = bpf_map_lookup_elem(&counters, &key);

	if (v)
		*v += 1;
	note(c);
}

/* packet_begin clears what count() notes, at the start of a program run. */
static __always_inline void packet_begin(void)
{
	struct pkt_outcome *o = outcome();

	if (o) {
		o->translated = 0;
		o->reason = DROP_OTHER;
	}
}

/* packet_done adds the packet to its device's counters and returns verdict. */
static __always_inline int packet_done(struct __sk_buff *skb, __u8 dir, int verdict)
{
	struct dev_counter_key k = { .ifindex = skb->ifindex, .family = FAMILY_OTHER, .dir = dir };
	struct pkt_outcome *o = outcome();
	struct dev_counter_val *d;

	if (!o)
		return verdict;
	if (skb->protocol == bpf_htons(ETH_P_IP))
		k.family = FAMILY_IPV4;
	else if (skb->protocol == bpf_htons(ETH_P_IPV6))
		k.family = FAMILY_IPV6;
	d = bpf_map_lookup_elem(&dev_counters, &k);
	if (!d) {
		/* A full map (4096 device/family/direction keys) loses the
		 * count, never the packet. */
		bpf_map_update_elem(&dev_counters, &k, &o->zero, BPF_NOEXIST);
		d = bpf_map_lookup_elem(&dev_counters, &k);
		if (!d)
			return verdict;
	}
	if (verdict == TC_ACT_SHOT) {
		d->packets[ACTION_DROPPED] += 1;
		if (o->reason < DROP_REASON_MAX)
			d->drops[o->reason] += 1;
	} else if (o->translated) {
		d->packets[ACTION_TRANSLATED] += 1;
	} else {
		d->packets[ACTION_PASSED] += 1;
	}
	return verdict;
}

#endif /* IPMASQ_LIB_COUNTERS_H */
