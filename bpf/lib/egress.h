/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The egress path: every packet leaving through an egress device. */

#ifndef IPMASQ_LIB_EGRESS_H
#define IPMASQ_LIB_EGRESS_H

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
#include "decision.h"
#include "flow.h"
#include "inbound.h"
#include "hostflow.h"
#include "ports.h"
#include "pressure.h"
#include "rewrite.h"
#include "frag.h"
#include "icmp.h"
#include "icmp_egress.h"
#include "fixed.h"
#include "unmasq.h"
#include "handover.h"

#define FAMILY 4
#include "egress_fam.h"
#define FAMILY 6
#include "egress_fam.h"

static __always_inline int egress(struct __sk_buff *skb, __u32 l3_off)
{
	switch (skb->protocol) {
	case bpf_htons(ETH_P_IP):
		return egress_v4(skb, l3_off);
	case bpf_htons(ETH_P_IPV6):
		return egress_v6(skb, l3_off);
	}
	return TC_ACT_UNSPEC;
}

#endif /* IPMASQ_LIB_EGRESS_H */
