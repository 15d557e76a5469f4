//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * ipmasq datapath: source NAT (masquerade) on the node's egress devices.
 *
 * Two tc programs run on every selected egress device (attached with tcx):
 *
 *   ipmasq_egress   decides per new flow whether to masquerade (source a
 *                   masquerade source in masq_src_* (by default every one
 *                   but the node's addresses) or in a masq_rules_* entry for the egress
 *                   device, destination neither a node address nor "do not
 *                   masquerade" in nonmasq_*, an SNAT address of the family:
 *                   the rule's or the device's), allocates a NAT port and
 *                   rewrites the source; established flows take one NAT
 *                   lookup.
 *   ipmasq_ingress  reverse-translates replies and the ICMP errors that
 *                   belong to translated flows.
 *
 * NAT state lives in nat_v4/nat_v6, one entry per direction of each flow:
 *
 *   dir 0 (egress):  {pod, remote, pod port, remote port}   -> {SNAT addr, NAT port}
 *   dir 1 (ingress): {remote, SNAT addr, remote port, NAT port} -> {pod, pod port}
 *
 * "pod" stands for any masqueraded source, a pod or a user rule's source.
 * For ICMP echo the identifier is the port: sport on the request (dport 0),
 * dport on the reply (sport 0). Entries are rarely removed here (to undo a
 * lost race, or to free a pair that expired): a garbage collector in the
 * agent expires idle pairs using last_seen_ns, created_ns and the TCP flags
 * recorded in each entry, and a full table drops a pair that is not assured
 * for a new flow (lib/pressure.h), even while the agent is down.
 *
 * Both programs return TC_ACT_UNSPEC so that other tcx programs still run,
 * and TC_ACT_SHOT only when a packet of a flow that must be masqueraded
 * cannot be: the pod address is never sent out.
 *
 * Every run is counted per device, family and direction by its outcome
 * (lib/counters.h: packet_begin, packet_done).
 *
 * Each program comes in two variants: ipmasq_egress/ipmasq_ingress for
 * Ethernet devices (the network header at ETH_HLEN) and *_l3 for devices
 * without a link-layer header (tun, WireGuard, ipip, ...: the network
 * header at 0). The agent attaches the variant that fits the device's kind.
 */

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>

#include "lib/egress.h"
#include "lib/ingress.h"
#include "lib/natgc.h"
#include "lib/handover.h"
#include "lib/compat.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Ethernet devices: the network header follows the Ethernet header. */
SEC("tc")
int ipmasq_egress(struct __sk_buff *skb)
{
	packet_begin();
	return packet_done(skb, DIR_EGRESS, egress(skb, ETH_HLEN));
}

/* Devices without a link-layer header (tun, WireGuard, ipip, sit, ip6tnl,
 * point-to-point GRE): tc sees the packet from its network header. The
 * offset is a constant per program, so the verifier and the compiler see
 * the same code as the Ethernet variant's. */
SEC("tc")
int ipmasq_egress_l3(struct __sk_buff *skb)
{
	packet_begin();
	return packet_done(skb, DIR_EGRESS, egress(skb, 0));
}

SEC("tc")
int ipmasq_ingress(struct __sk_buff *skb)
{
	packet_begin();
	return packet_done(skb, DIR_INGRESS, ingress(skb, ETH_HLEN));
}

SEC("tc")
int ipmasq_ingress_l3(struct __sk_buff *skb)
{
	packet_begin();
	return packet_done(skb, DIR_INGRESS, ingress(skb, 0));
}

/* The agent's collector: end one NAT pair if it is still expired, as the
 * programs judge and claim pairs (lib/natgc.h). Run with BPF_PROG_TEST_RUN
 * (lib/compat.h: AGENT_RUN). */
AGENT_RUN(nat_gc_v4, struct nat_gc_v4_ctx)
{
	return nat_gc_end_v4(&c->key, c->force);
}

AGENT_RUN(nat_gc_v6, struct nat_gc_v6_ctx)
{
	return nat_gc_end_v6(&c->key, c->force);
}

/* The agent's handover of flows between conntrack and the NAT pairs: adopt
 * a conntrack binding as a pair, or mark a pair handed to conntrack
 * (lib/handover.h). Run with BPF_PROG_TEST_RUN (lib/compat.h: AGENT_RUN). */
AGENT_RUN(nat_handover_v4, struct nat_handover_v4_ctx)
{
	return nat_handover_run_v4(c);
}

AGENT_RUN(nat_handover_v6, struct nat_handover_v6_ctx)
{
	return nat_handover_run_v6(c);
}
