/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The port search of ports.h for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers
 * it uses.
 *
 * Defines: node_socket_v4, node_socket_v6, nat_try_v4, nat_try_v6,
 * nat_create_v4, nat_create_v6, struct nat_v4_create_scratch,
 * struct nat_v6_create_scratch, nat_create_scratch_v4, nat_create_scratch_v6.
 */

#include "family.h"

/* node_socket_v4/v6 says whether a socket of the node owns the reply tuple
 * in: a connection (any state, TIME_WAIT included), a listener or a bound
 * UDP socket. A port outside the NAT range is not reserved from the node,
 * so a flow takes one only where no node socket would get its replies
 * (conntrack's nf_nat_used_tuple, asked of the socket table). */
static __always_inline int FAM(node_socket)(struct __sk_buff *skb, const FAM_T(nat, key) *in)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	__u32 len;

#if FAM_IS_V6
	__builtin_memcpy(t.ipv6.saddr, in->src, 16);
	__builtin_memcpy(t.ipv6.daddr, in->dst, 16);
	t.ipv6.sport = in->sport;
	t.ipv6.dport = in->dport;
	len = sizeof(t.ipv6);
#else
	t.ipv4.saddr = in->src;
	t.ipv4.daddr = in->dst;
	t.ipv4.sport = in->sport;
	t.ipv4.dport = in->dport;
	len = sizeof(t.ipv4);
#endif
	if (in->proto == IPPROTO_TCP)
		sk = bpf_skc_lookup_tcp(skb, &t, len, BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_udp(skb, &t, len, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	bpf_sk_release(sk);
	return 1;
}

/* The key and value nat_try and nat_create give the map helpers: their
 * callers' (pointer arguments of a global function) are no map key or value
 * before 6.2 (lib/compat.h: "Keys"), and copies on the stack would take
 * the IPv6 egress path's stack over 512 bytes. Per CPU; the two never use
 * it at the same time (nat_create after its nat_try calls), and a tc
 * program runs to its end on its CPU. */
FAM_T(nat, create_scratch) {
	FAM_T(nat, key) key;
	FAM_T(nat, val) val;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, FAM_T(nat, create_scratch));
	__uint(max_entries, 1);
} FAM(nat_create_scratch) SEC(".maps");

/* nat_try_v4/v6 tries the walk's next port (into in->dport): PORT_FREE or
 * PORT_REUSED when the reply entry rev (stamped now) is in, PORT_TAKEN,
 * PORT_FULL, or PORT_DONE when the walk is over. The reply entry is looked
 * up first: an insert that fails costs more than a lookup, and a port in
 * use is most of what a busy search meets. Its own frame: the search's
 * loop calls it, and the IPv6 egress stack stays under 512. */
__noinline int FAM(nat_try)(struct __sk_buff *skb, FAM_T(nat, key) *in, FAM_T(nat, val) *rev,
			    struct port_walk *w)
{
	struct masq_config *cfg = masq_cfg();
	FAM_T(nat, create_scratch) *s;
	FAM_T(nat, val) *r;
	__u32 port, harder = 0, zero = 0;
	long ret;

	s = bpf_map_lookup_elem(&FAM(nat_create_scratch), &zero);
	if (!skb || !in || !rev || !w || !cfg || !s)
		return PORT_DONE;
	port = port_next(w, &harder);
	if (!port)
		return PORT_DONE;
	in->dport = bpf_htons(port);
	/* The map's key and value, copied (see nat_create_scratch). */
	s->key = *in;
	s->val = *rev;
	if (!nat_port_in_range(cfg, port) && FAM(node_socket)(skb, &s->key))
		return PORT_TAKEN;
	r = bpf_map_lookup_elem(&FAM(nat), &s->key);
	if (r) {
		if (!FAM(nat_takeover)(&s->key, r, s->val.addr, s->val.last_seen_ns, harder))
			return PORT_TAKEN;
		/* Claimed: the reply entry is this flow's to replace, with no
		 * flag of the old pair's (and never left claimed). */
		if (FAM(nat_replace)(&s->key, &s->val) == 0)
			return PORT_REUSED;
		FAM(nat_delete)(&s->key);
		return PORT_TAKEN;
	}
	ret = FAM(nat_insert)(&s->key, &s->val);
	if (ret == 0)
		return PORT_FREE;
	return ret == -EEXIST ? PORT_TAKEN : PORT_FULL;
}

/* nat_create_v4/v6 finds a NAT port for the egress tuple out (the search
 * of ports.h) and inserts both entries of its pair. The reply (dir 1)
 * entry goes in first: its key holds the remote address and port, so a
 * port is taken only toward that destination. res->addr holds the SNAT
 * address on entry (a global function's pointer must point to a whole
 * struct), and again on every failure (the caller may make room and
 * retry). On success *res holds the mapping and the result is
 * COUNTER_NAT_NEW (or COUNTER_MASQUERADED when another CPU created the
 * same flow concurrently); otherwise the counter of the drop reason:
 * COUNTER_NAT_FULL when the map is full (the caller may drop a pair that
 * is not assured and retry, see lib/pressure.h), COUNTER_NO_PORT when the
 * search found none. */
__noinline enum counter FAM(nat_create)(struct __sk_buff *skb, const FAM_T(nat, key) *out, __u8 flags,
					FAM_T(nat, val) *res)
{
	FAM_T(nat, key) in = {};
	FAM_T(nat, create_scratch) *s;
	struct port_walk w;
	FAM_T(nat, val) *cur;
	struct masq_config *cfg;
	int got = PORT_DONE;
	__u64 now;
	__u32 i, zero = 0;
	long ret;

	if (!skb || !out || !res)
		return COUNTER_ERROR;
	cfg = masq_cfg();
	if (!cfg || cfg->port_min == 0 || cfg->port_max < cfg->port_min)
		return COUNTER_NO_PORT;

	now = bpf_ktime_get_ns();
	FAM_ADDR_COPY(in.src, out->dst);
	FAM_ADDR_COPY(in.dst, res->addr);
	in.sport = out->dport;
	in.proto = out->proto;
	in.dir = DIR_INGRESS;
	/* res is the reply entry until a port is found (stack room) */
	FAM_ADDR_COPY(res->addr, out->src);
	res->port = out->sport;
	res->flags = 0;
	res->handover = NAT_HANDOVER_NONE;
#if FAM_IS_V6
	res->pad[0] = res->pad[1] = res->pad[2] = res->pad[3] = 0;
#endif
	res->last_seen_ns = now;
	res->created_ns = now;
	res->tcp_end = 0;
	res->pad2 = 0;

	port_walk_init(&w, cfg, out->proto, flags, out->sport);
	for (i = 0; i < PORT_PROBES; i++) {
		got = FAM(nat_try)(skb, &in, res, &w);
		if (got != PORT_TAKEN)
			break;
	}
	/* res->addr is the SNAT address again, whatever the outcome */
	FAM_ADDR_COPY(res->addr, in.dst);
	if (got == PORT_FULL)
		return COUNTER_NAT_FULL;
	if (got != PORT_FREE && got != PORT_REUSED)
		return COUNTER_NO_PORT;
	if (got == PORT_REUSED)
		count(COUNTER_NAT_REUSED);
	cfg = masq_cfg();
	if (cfg && in.dport == out->sport && keep_port(cfg, out->proto, out->sport))
		count(COUNTER_NAT_PORT_KEPT);

	res->port = in.dport;
	res->flags = flags & NAT_F_STORED;
	res->last_seen_ns = now;
	res->created_ns = now;
	/* The map's key and value, copied (see nat_create_scratch). */
	s = bpf_map_lookup_elem(&FAM(nat_create_scratch), &zero);
	if (!s)
		return COUNTER_ERROR;
	s->key = *out;
	s->val = *res;
	ret = FAM(nat_insert)(&s->key, &s->val);
	if (ret == 0) {
		/* not assured yet: early drop may take it (evict.h) */
		FAM(nat_cand_note)(&in, now);
		return COUNTER_NAT_NEW;
	}
	FAM(nat_delete)(&in);
	if (ret != -EEXIST)
		return COUNTER_NAT_FULL;
	/* Lost a race with another CPU translating the same flow: use its pair. */
	cur = bpf_map_lookup_elem(&FAM(nat), &s->key);
	if (!cur)
		return COUNTER_ERROR;
	*res = *cur;
	return COUNTER_MASQUERADED;
}

#undef FAMILY
#include "family.h"
