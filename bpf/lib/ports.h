/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* NAT port search: the candidates of a new flow and creating its pair. */

#ifndef IPMASQ_LIB_PORTS_H
#define IPMASQ_LIB_PORTS_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <asm-generic/errno-base.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "flow.h"

/* Linear probes for a free NAT port before giving up on a new flow. */
#define PORT_PROBES	32
#define PORT_PROBES_HASHED 8
/* Probes that may take over an expired or closed pair's port. */
#define PORT_PROBES_REUSE 16
/* With MASQ_CFG_KEEP_PORT, random ports from 1024-65535 outside the range
 * tried for a flow whose own port is taken, before the range (Linux remaps
 * a clash into 1024-65535). */
#define PORT_PROBES_WIDE 8
#define PORT_WIDE_MIN	1024
/* nat_create_v4/v6 flags argument: a node flow's remap, which takes a port
 * of the range only (never stored). */
#define NAT_CREATE_NODE	0x80

static __always_inline __u32 mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

/* The first NAT port tried for a flow is a hash of the pod's tuple, not a
 * random number: a pod that reuses a tuple (same source port to the same
 * server) gets the same NAT port back, so the server sees one peer whose TCP
 * timestamps keep increasing (no PAWS drop against its TIME_WAIT socket). */
static __always_inline __u32 tuple_hash(__u32 src, __u32 dst, __be16 sport, __be16 dport, __u8 proto)
{
	return mix32(src ^ mix32(dst ^ mix32(((__u32)sport << 16 | dport) ^ proto)));
}

/* probe_offset is the i-th port tried: the first PORT_PROBES_HASHED follow
 * the tuple's hash (the same tuple gets the same port back), the rest are
 * random. Without the random probes a busy range would fail the same tuple
 * forever: a retried SYN has the same tuple, so it would probe the same
 * taken ports again and again. */
static __always_inline __u32 probe_offset(__u32 start, __u32 i)
{
	if (i < PORT_PROBES_HASHED)
		return start + i;
	return bpf_get_prandom_u32();
}

/* first_port is the offset in the range of the first port tried: the
 * source's own port when the range holds it (as Linux keeps it), else a
 * hash of the tuple. */
static __always_inline __u32 first_port(const struct masq_config *cfg, __be16 sport, __u32 hash,
					__u32 range)
{
	__u16 own = bpf_ntohs(sport);

	if (own >= cfg->port_min && own <= cfg->port_max)
		return own - cfg->port_min;
	return hash % range;
}

/* keep_port says whether a new flow first tries its own source port, as
 * Linux MASQUERADE does: TCP and UDP ports from 1024 outside the NAT range
 * (a port inside it is the range's first probe anyway). */
static __always_inline int keep_port(const struct masq_config *cfg, __u8 proto, __be16 sport)
{
	__u16 own = bpf_ntohs(sport);

	return (cfg->flags & MASQ_CFG_KEEP_PORT) && own >= 1024 &&
	       (own < cfg->port_min || own > cfg->port_max) &&
	       (proto == IPPROTO_TCP || proto == IPPROTO_UDP);
}

/* wide_ports says whether a new flow whose own port is taken first tries
 * random ports outside the range (wide_port): TCP and UDP flows of pods
 * when ports are kept. A node flow's remap stays in the range, which the
 * node's kernel never picks on its own. */
static __always_inline int wide_ports(const struct masq_config *cfg, __u8 proto, __u8 flags)
{
	return (cfg->flags & MASQ_CFG_KEEP_PORT) && !(flags & NAT_CREATE_NODE) &&
	       (proto == IPPROTO_TCP || proto == IPPROTO_UDP);
}

/* wide_port is a random port of 1024-65535 outside the range, in network
 * byte order; 0 when the draw fell inside the range (the caller draws
 * again). Random, not hashed: a port whose pair still exists is never
 * taken here (no reuse check), so the server's TIME_WAIT sockets of
 * recent pairs are safe. */
static __always_inline __be16 wide_port(const struct masq_config *cfg)
{
	__u32 port = PORT_WIDE_MIN + bpf_get_prandom_u32() % (65536 - PORT_WIDE_MIN);

	if (port >= cfg->port_min && port <= cfg->port_max)
		return 0;
	return bpf_htons(port);
}

/* A new flow's port candidates, in order: its own port (keep_port),
 * PORT_PROBES_WIDE random ports outside the range (wide_ports), then
 * PORT_PROBES ports of the range from first_port. The first two kinds are
 * checked against the node's sockets: the node may use those ports. */
#define CAND_OWN	0
#define CAND_RANGE	(1 + PORT_PROBES_WIDE)
#define CANDIDATES	(CAND_RANGE + PORT_PROBES)

/* candidate_port is candidate i's port in network byte order, or 0 when it
 * does not apply to this flow. */
static __always_inline __be16 candidate_port(const struct masq_config *cfg, __u32 i, __be16 sport,
					     __u8 proto, __u8 flags, __u32 start, __u32 range)
{
	if (i == CAND_OWN)
		return keep_port(cfg, proto, sport) ? sport : 0;
	if (i < CAND_RANGE)
		return wide_ports(cfg, proto, flags) ? wide_port(cfg) : 0;
	return bpf_htons(cfg->port_min + probe_offset(start, i - CAND_RANGE) % range);
}

/* candidate_reuses says whether candidate i may take over a pair that is
 * over (nat_reusable_*): the flow's own port, and the first
 * PORT_PROBES_REUSE ports of the range. A random port is only taken free. */
static __always_inline int candidate_reuses(__u32 i)
{
	return i == CAND_OWN || (i >= CAND_RANGE && i - CAND_RANGE < PORT_PROBES_REUSE);
}

/* node_socket_v4 says whether a socket of the node owns the reply tuple in:
 * a connection (any state, TIME_WAIT included), a listener or a bound UDP
 * socket. A port outside the NAT range is not reserved from the node, so a
 * flow keeps its own port only where no node socket would get its replies
 * (conntrack's nf_nat_used_tuple, asked of the socket table). */
static __always_inline int node_socket_v4(struct __sk_buff *skb, const struct nat_v4_key *in)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;

	t.ipv4.saddr = in->src;
	t.ipv4.daddr = in->dst;
	t.ipv4.sport = in->sport;
	t.ipv4.dport = in->dport;
	if (in->proto == IPPROTO_TCP)
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_udp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	bpf_sk_release(sk);
	return 1;
}

/* node_socket_v6 is node_socket_v4 for IPv6. */
static __always_inline int node_socket_v6(struct __sk_buff *skb, const struct nat_v6_key *in)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;

	__builtin_memcpy(t.ipv6.saddr, in->src, 16);
	__builtin_memcpy(t.ipv6.daddr, in->dst, 16);
	t.ipv6.sport = in->sport;
	t.ipv6.dport = in->dport;
	if (in->proto == IPPROTO_TCP)
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_udp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	bpf_sk_release(sk);
	return 1;
}

/* nat_create_v4 allocates a NAT port for the egress tuple out and inserts
 * both entries. The reply (dir 1) entry goes in first with BPF_NOEXIST: its
 * key holds the remote address and port, so a port is taken only for that
 * destination. With MASQ_CFG_KEEP_PORT, the source's own port is tried
 * first (keep_port; where no node socket owns the tuple), then the range. A
 * port whose dir-1 entry exists is still taken when nat_reusable_v4 allows
 * it (expired, half, or closed by the same source). On success *res holds the mapping and the result is COUNTER_NAT_NEW (or
 * COUNTER_MASQUERADED when another CPU created the same flow concurrently);
 * otherwise the counter of the drop reason: COUNTER_NAT_FULL when the map
 * is full (the caller may drop a pair that is not assured and retry, see
 * lib/pressure.h). */
__noinline enum counter nat_create_v4(struct __sk_buff *skb, const struct nat_v4_key *out,
				      __be32 snat, __u8 flags, struct nat_v4_val *res)
{
	struct nat_v4_key in = {};
	struct nat_v4_val rev = {};
	struct nat_v4_val *cur;
	struct masq_config *cfg;
	__u32 start, range, i;
	__u64 now;
	long ret;

	if (!skb || !out || !res)
		return COUNTER_ERROR;
	cfg = masq_cfg();
	if (!cfg || cfg->port_min == 0 || cfg->port_max < cfg->port_min)
		return COUNTER_NO_PORT;
	range = (__u32)cfg->port_max - cfg->port_min + 1;

	now = bpf_ktime_get_ns();
	in.src = out->dst;
	in.dst = snat;
	in.sport = out->dport;
	in.proto = out->proto;
	in.dir = DIR_INGRESS;
	rev.addr = out->src;
	rev.port = out->sport;
	rev.last_seen_ns = now;
	rev.created_ns = now;

	start = first_port(cfg, out->sport,
			   tuple_hash(out->src, out->dst, out->sport, out->dport, out->proto), range);
	for (i = 0; i < CANDIDATES; i++) {
		in.dport = candidate_port(cfg, i, out->sport, out->proto, flags, start, range);
		if (!in.dport || (i < CAND_RANGE && node_socket_v4(skb, &in)))
			continue;
		ret = bpf_map_update_elem(&nat_v4, &in, &rev, BPF_NOEXIST);
		if (ret == 0)
			goto found;
		if (ret != -EEXIST)
			return COUNTER_NAT_FULL;
		if (!candidate_reuses(i))
			continue;
		ret = nat_reusable_v4(&in, out->src, now);
		if (!ret)
			continue;
		/* Claimed: the reply entry is this flow's to replace (and
		 * never left claimed). Gone meanwhile: others may take it too. */
		if (ret == NAT_REUSE_CLAIMED) {
			if (bpf_map_update_elem(&nat_v4, &in, &rev, BPF_ANY) == 0)
				goto reused;
			bpf_map_delete_elem(&nat_v4, &in);
		} else if (bpf_map_update_elem(&nat_v4, &in, &rev, BPF_NOEXIST) == 0) {
			goto reused;
		}
	}
	return COUNTER_NO_PORT;

reused:
	count(COUNTER_NAT_REUSED);
found:
	if (i == CAND_OWN)
		count(COUNTER_NAT_PORT_KEPT);
	res->addr = snat;
	res->port = in.dport;
	res->flags = flags & NAT_F_STORED;
	res->last_seen_ns = now;
	res->created_ns = now;
	ret = bpf_map_update_elem(&nat_v4, out, res, BPF_NOEXIST);
	if (ret == 0)
		return COUNTER_NAT_NEW;
	bpf_map_delete_elem(&nat_v4, &in);
	if (ret != -EEXIST)
		return COUNTER_NAT_FULL;
	/* Lost a race with another CPU translating the same flow: use its pair. */
	cur = bpf_map_lookup_elem(&nat_v4, out);
	if (!cur)
		return COUNTER_ERROR;
	*res = *cur;
	return COUNTER_MASQUERADED;
}

/* nat_create_v6 is nat_create_v4 for IPv6; res->addr holds the SNAT address
 * on entry (a global function's pointer must point to a whole struct), and
 * again after COUNTER_NAT_FULL (the caller may make room and retry). */
__noinline enum counter nat_create_v6(struct __sk_buff *skb, const struct nat_v6_key *out,
				      __u8 flags, struct nat_v6_val *res)
{
	__u32 start, range, s, d, s_hi, d_hi, i;
	struct nat_v6_key in = {};
	struct nat_v6_val *cur;
	struct masq_config *cfg;
	__u64 now;
	long ret;

	if (!skb || !out || !res)
		return COUNTER_ERROR;
	cfg = masq_cfg();
	if (!cfg || cfg->port_min == 0 || cfg->port_max < cfg->port_min)
		return COUNTER_NO_PORT;
	range = (__u32)cfg->port_max - cfg->port_min + 1;

	now = bpf_ktime_get_ns();
	__builtin_memcpy(in.src, out->dst, 16);
	__builtin_memcpy(in.dst, res->addr, 16);
	in.sport = out->dport;
	in.proto = out->proto;
	in.dir = DIR_INGRESS;
	/* res is the reply entry's value until a port is found (stack room). */
	__builtin_memcpy(res->addr, out->src, 16);
	res->port = out->sport;
	res->flags = 0;
	res->pad[0] = res->pad[1] = res->pad[2] = res->pad[3] = res->pad[4] = 0;
	res->last_seen_ns = now;
	res->created_ns = now;

	/* The low 64 bits carry the interface identifier: fold them in. */
	__builtin_memcpy(&s, &out->src[12], 4);
	__builtin_memcpy(&d, &out->dst[12], 4);
	__builtin_memcpy(&s_hi, &out->src[8], 4);
	__builtin_memcpy(&d_hi, &out->dst[8], 4);
	s ^= mix32(s_hi);
	d ^= mix32(d_hi);
	start = first_port(cfg, out->sport, tuple_hash(s, d, out->sport, out->dport, out->proto), range);
	for (i = 0; i < CANDIDATES; i++) {
		in.dport = candidate_port(cfg, i, out->sport, out->proto, flags, start, range);
		if (!in.dport || (i < CAND_RANGE && node_socket_v6(skb, &in)))
			continue;
		ret = bpf_map_update_elem(&nat_v6, &in, res, BPF_NOEXIST);
		if (ret == 0)
			goto found;
		if (ret != -EEXIST) {
			/* res->addr is the SNAT address again, for a retry */
			__builtin_memcpy(res->addr, in.dst, 16);
			return COUNTER_NAT_FULL;
		}
		if (!candidate_reuses(i))
			continue;
		ret = nat_reusable_v6(&in, out, now);
		if (!ret)
			continue;
		/* Claimed: the reply entry is this flow's to replace (and
		 * never left claimed). Gone meanwhile: others may take it too. */
		if (ret == NAT_REUSE_CLAIMED) {
			if (bpf_map_update_elem(&nat_v6, &in, res, BPF_ANY) == 0)
				goto reused;
			bpf_map_delete_elem(&nat_v6, &in);
		} else if (bpf_map_update_elem(&nat_v6, &in, res, BPF_NOEXIST) == 0) {
			goto reused;
		}
	}
	return COUNTER_NO_PORT;

reused:
	count(COUNTER_NAT_REUSED);
found:
	if (i == CAND_OWN)
		count(COUNTER_NAT_PORT_KEPT);
	__builtin_memcpy(res->addr, in.dst, 16);
	res->port = in.dport;
	res->flags = flags & NAT_F_STORED;
	res->last_seen_ns = now;
	res->created_ns = now;
	ret = bpf_map_update_elem(&nat_v6, out, res, BPF_NOEXIST);
	if (ret == 0)
		return COUNTER_NAT_NEW;
	bpf_map_delete_elem(&nat_v6, &in);
	if (ret != -EEXIST)
		return COUNTER_NAT_FULL;
	cur = bpf_map_lookup_elem(&nat_v6, out);
	if (!cur)
		return COUNTER_ERROR;
	*res = *cur;
	return COUNTER_MASQUERADED;
}

#endif /* IPMASQ_LIB_PORTS_H */
