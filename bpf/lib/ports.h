/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * NAT port search: the port of a new flow and creating its pair.
 *
 * As Linux's nf_nat_l4proto_unique_tuple (net/netfilter/nf_nat_proto.c):
 * a flow keeps its own port when free; otherwise the search walks
 * PORT_ROUND consecutive ports of the space from a random offset, then half
 * as many from a new random offset, while the last round had at least
 * PORT_ROUND_MIN (128, 64, 32, 16, 8: 248 ports), or the whole space once
 * when it is smaller. The space is
 * 1024-65535 for TCP/UDP flows with MASQ_CFG_KEEP_PORT (MASQUERADE without
 * --to-ports), the NAT range (--nat-port-range) otherwise, and for ICMP
 * ids and node flows always. A port is taken when no pair holds it
 * toward the flow's destination (its reply entry is looked up before the
 * BPF_NOEXIST insert) or when the pair holding it is over: expired (a
 * conntrack entry would be gone), or, in the last PORT_HARDER probes of a
 * round (Linux's nf_nat_used_tuple_harder), closed without a TIME_WAIT on
 * the server that would refuse the new SYN (flow.h, nat_takeover). A port
 * is also checked against the node's sockets: nothing is reserved from the
 * node (no sysctl is written), so its kernel may use any port, in the NAT
 * range too, and a port a node socket owns toward the flow's destination
 * is skipped, as conntrack's nf_nat_used_tuple skips a tuple the node's
 * own connection holds.
 *
 * MASQ_CFG_RANDOM_FULLY is MASQUERADE --random-fully: the flow's own port
 * is not tried first, every flow starts at a random offset of its space.
 *
 * Several NAT ranges (the Kubernetes agent's --to-ports=1024-29999,
 * 32768-65535) are their union: the walk draws indexes into nat_ports, so
 * a port is as likely as under that agent's one MASQUERADE --to-ports rule
 * per range, each taking a new connection with the probability of its
 * share of the ports, and a flow is refused only when the walk over the
 * whole union finds no port.
 */

#ifndef IPMASQ_LIB_PORTS_H
#define IPMASQ_LIB_PORTS_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <asm-generic/errno-base.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "compat.h"
#include "counters.h"
#include "maps.h"
#include "flow.h"
#include "evict.h"

/* The ports of several NAT ranges, in order (types.h). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct nat_port_block);
	__uint(max_entries, 65536 / NAT_PORTS_BLOCK);
} nat_ports SEC(".maps");

/* The same ports as bits: bit p % 64 of entry p / 64. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 65536 / 64);
} nat_port_set SEC(".maps");

/* Linux's NF_NAT_MAX_ATTEMPTS, the first round; each next round is half as
 * long, after a round of PORT_ROUND_MIN or more. */
#define PORT_ROUND	128
#define PORT_ROUND_MIN	16
/* The probes of all rounds, and the flow's own port first. */
#define PORT_PROBES	(1 + PORT_ROUND + PORT_ROUND / 2 + PORT_ROUND / 4 + PORT_ROUND / 8 + PORT_ROUND / 16)
/* Linux's NF_NAT_HARDER_THRESH: the last probes of a round may take over a
 * closed pair. */
#define PORT_HARDER	(PORT_ROUND / 4)
/* With MASQ_CFG_KEEP_PORT, the space a TCP/UDP flow of a pod searches. */
#define PORT_WIDE_MIN	1024
/* port_next: an index of nat_ports without a port (never a port number). */
#define PORT_SKIP	0x10000
/* nat_create_v4/v6 flags argument: a node flow's remap, which takes a port
 * of the range only (never stored). */
#define NAT_CREATE_NODE	0x80
/* nat_create_v4/v6 flags argument: the same flow's create again after an
 * early drop made room (never stored): the port its search found free,
 * whose insert the full table refused, is inserted at once (lib/ports_fam.h). */
#define NAT_CREATE_RETRY	0x40

/* nat_try_v4/v6 results. */
#define PORT_TAKEN	0	/* try the next port */
#define PORT_FREE	1	/* the reply entry is in: the port is the flow's */
#define PORT_REUSED	2	/* the same, over a pair that was over */
#define PORT_FULL	3	/* the map is full */
#define PORT_DONE	4	/* the search is over */

/* nat_port_in_range says whether port (host byte order) is one of the NAT
 * ranges. */
static __always_inline int nat_port_in_range(const struct masq_config *cfg, __u32 port)
{
	__u32 key = (port & 0xffff) / 64;
	__u64 *bits;

	if (port < cfg->port_min || port > cfg->port_max)
		return 0;
	if (cfg->port_ranges <= 1)
		return 1;
	bits = bpf_map_lookup_elem(&nat_port_set, &key);
	return bits && (*bits >> (port % 64)) & 1;
}

/* nat_port_at is the index-th port of several NAT ranges (nat_ports), 0
 * when there is none (the agent writing the ranges meanwhile). */
static __always_inline __u32 nat_port_at(__u32 index)
{
	__u32 key = (index & 0xffff) / NAT_PORTS_BLOCK;
	struct nat_port_block *b = bpf_map_lookup_elem(&nat_ports, &key);

	return b ? b->port[index % NAT_PORTS_BLOCK] : 0;
}

/* keep_port says whether a flow's own port is one Linux MASQUERADE keeps
 * outside the NAT range: TCP and UDP ports from 1024 of pods, with
 * MASQ_CFG_KEEP_PORT. Such a port is counted as kept when the flow gets
 * it (COUNTER_NAT_PORT_KEPT). */
static __always_inline int keep_port(const struct masq_config *cfg, __u8 proto, __be16 sport)
{
	__u16 own = bpf_ntohs(sport);

	return (cfg->flags & MASQ_CFG_KEEP_PORT) && own >= PORT_WIDE_MIN &&
	       !nat_port_in_range(cfg, own) &&
	       (proto == IPPROTO_TCP || proto == IPPROTO_UDP);
}

/* port_space sets the space a new flow searches: ports [*min, *min + *size),
 * or with several NAT ranges (*list), indexes [0, *size) of nat_ports. */
static __always_inline void port_space(const struct masq_config *cfg, __u8 proto, __u8 flags,
				       __u32 *min, __u32 *size, __u8 *list)
{
	*list = 0;
	if ((cfg->flags & MASQ_CFG_KEEP_PORT) && !(flags & NAT_CREATE_NODE) &&
	    (proto == IPPROTO_TCP || proto == IPPROTO_UDP)) {
		*min = PORT_WIDE_MIN;
		*size = 65536 - PORT_WIDE_MIN;
		return;
	}
	*min = cfg->port_min;
	*size = (__u32)cfg->port_max - cfg->port_min + 1;
	if (cfg->port_ranges <= 1 || !cfg->port_total)
		return;
	*list = 1;
	*min = 0;
	*size = cfg->port_total;
}

/* The walk through the space: the state of the rounds. */
struct port_walk {
	__u32 min, size;	/* the space */
	__u32 off;		/* the next port's offset in it */
	__u16 round;		/* this round's length */
	__u16 left;		/* its probes not yet made */
	__u16 own;		/* the flow's own port, tried first; 0 once tried */
	__u8 list;		/* the space is indexes of nat_ports */
	__u8 pad;
};

/* port_walk_init starts the walk of a new flow with own port sport. */
static __always_inline void port_walk_init(struct port_walk *w, const struct masq_config *cfg, __u8 proto,
					   __u8 flags, __be16 sport)
{
	port_space(cfg, proto, flags, &w->min, &w->size, &w->list);
	w->round = w->size < PORT_ROUND ? w->size : PORT_ROUND;
	w->left = w->round;
	w->off = bpf_get_prandom_u32();
	w->own = bpf_ntohs(sport);
	/* --random-fully: no port is the flow's by right (ICMP ids and node
	 * flows never keep theirs either way). */
	if ((cfg->flags & MASQ_CFG_RANDOM_FULLY) && !(flags & NAT_CREATE_NODE) &&
	    (proto == IPPROTO_TCP || proto == IPPROTO_UDP))
		w->own = 0;
	w->pad = 0;
}

/* port_next is the next port of the walk (host byte order), and says in
 * *harder whether it may take over a closed pair: the flow's own port, and
 * the last PORT_HARDER of a round; 0 when the search is over: the whole
 * space walked, or the last round done; PORT_SKIP for an index of
 * nat_ports that holds no port (being written). */
static __always_inline __u32 port_next(const struct masq_config *cfg, struct port_walk *w, __u32 *harder)
{
	__u32 port;

	port = w->own;
	w->own = 0;
	/* the own port where the space holds it */
	if (port && (w->list ? nat_port_in_range(cfg, port) : port >= w->min && port - w->min < w->size)) {
		*harder = 1;
		return port;
	}
	if (!w->left) {
		if (w->round >= w->size || w->round < PORT_ROUND_MIN)
			return 0;
		w->round /= 2;
		w->left = w->round;
		w->off = bpf_get_prandom_u32();
	}
	*harder = w->left <= PORT_HARDER;
	port = w->min + w->off % w->size;
	w->off++;
	w->left--;
	if (w->list) {
		port = nat_port_at(port);
		if (!port)
			return PORT_SKIP;
	}
	return port;
}

#define FAMILY 4
#include "ports_fam.h"
#define FAMILY 6
#include "ports_fam.h"

#endif /* IPMASQ_LIB_PORTS_H */
