/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The ingress path: replies and ICMP errors of translated flows. */

#ifndef IPMASQ_LIB_INGRESS_H
#define IPMASQ_LIB_INGRESS_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "flow.h"
#include "inbound.h"
#include "rewrite.h"
#include "frag.h"
#include "icmp.h"
#include "fixed.h"
#include "handover.h"

/* Misses are not counted on ingress: most packets are the host's own. */

#define FAMILY 4
#include "ingress_fam.h"
#define FAMILY 6
#include "ingress_fam.h"

static __always_inline int ingress(struct __sk_buff *skb, __u32 l3_off)
{
	switch (skb->protocol) {
	case bpf_htons(ETH_P_IP):
		return ingress_v4(skb, l3_off);
	case bpf_htons(ETH_P_IPV6):
		return ingress_v6(skb, l3_off);
	}
	return TC_ACT_UNSPEC;
}

#endif /* IPMASQ_LIB_INGRESS_H */
