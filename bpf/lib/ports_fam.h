/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The port search of ports.h for one family: a template, included once
 * with FAMILY 4 and once with FAMILY 6 (see family.h), after the headers
 * it uses.
 *
 * Defines: struct nat_v4_search, struct nat_v6_search, node_socket_v4,
 * node_socket_v6, nat_try_v4, nat_try_v6, nat_create_v4, nat_create_v6,
 * nat_new_pair_v4, nat_new_pair_v6, nat_search_v4, nat_search_v6.
 */

#include "family.h"

/* node_socket_v4/v6 says whether a socket of the node owns the reply tuple
 * in: a connection (any state, TIME_WAIT included), a listener or a bound
 * UDP socket (TCP and UDP; an ICMP echo id is no socket's). No port is reserved from the node, in the NAT range or out
 * of it, so a flow takes one only where no node socket would get its
 * replies (conntrack's nf_nat_used_tuple, asked of the socket table). */
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
	else if (in->proto == IPPROTO_UDP)
		sk = bpf_sk_lookup_udp(skb, &t, len, BPF_F_CURRENT_NETNS, 0);
	else
		return 0; /* ICMP echo ids: no socket owns one */
	if (!sk)
		return 0;
	bpf_sk_release(sk);
	return 1;
}

/* The port search's state, per CPU (a tc program runs to its end on its
 * CPU, and one search at a time): the reply entry's key (in), whose port
 * nat_try changes, the pair's egress key (out), the reply entry (rev),
 * the result (res: the SNAT address in, the mapping out) and the walk. In
 * a map value, not on the stack: the IPv6 egress chain is near 512 bytes,
 * and nat_create and nat_try, global functions the verifier checks once,
 * then take no pointer but the context (before 5.12 a global function
 * takes none other; before 6.2 none is a map key). */
FAM_T(nat, search) {
	FAM_T(nat, key) in;
	FAM_T(nat, key) out;
	FAM_T(nat, val) rev;
	FAM_T(nat, val) res;
	struct port_walk w;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, FAM_T(nat, search));
	__uint(max_entries, 1);
} FAM(nat_search) SEC(".maps");

/* nat_try_v4/v6 tries the walk's next port (into in.dport of the search
 * state): PORT_FREE or PORT_REUSED when the reply entry rev (stamped now)
 * is in, PORT_TAKEN, PORT_FULL, or PORT_DONE when the walk is over. The
 * reply entry is looked up first: an insert that fails costs more than a
 * lookup, and a port in use is most of what a busy search meets. Its own
 * frame: the search's loop calls it, and the IPv6 egress stack stays under
 * 512. */
__noinline int FAM(nat_try)(struct __sk_buff *skb)
{
	struct masq_config *cfg = masq_cfg();
	FAM_T(nat, search) *s;
	FAM_T(nat, val) *r;
	__u32 port, harder = 0, zero = 0;
	long ret;

	s = bpf_map_lookup_elem(&FAM(nat_search), &zero);
	if (!skb || !s || !cfg)
		return PORT_DONE;
	port = port_next(cfg, &s->w, &harder);
	if (!port)
		return PORT_DONE;
	if (port == PORT_SKIP)
		return PORT_TAKEN;
	s->in.dport = bpf_htons(port);
	if (FAM(node_socket)(skb, &s->in))
		return PORT_TAKEN;
	r = bpf_map_lookup_elem(&FAM(nat), &s->in);
	if (r) {
		if (!FAM(nat_takeover)(&s->in, r, s->rev.addr, s->rev.last_seen_ns, harder))
			return PORT_TAKEN;
		/* Claimed: the reply entry is this flow's to replace, with no
		 * flag of the old pair's (and never left claimed). */
		if (FAM(nat_replace)(&s->in, &s->rev) == 0)
			return PORT_REUSED;
		FAM(nat_delete)(&s->in);
		return PORT_TAKEN;
	}
	ret = FAM(nat_insert)(&s->in, &s->rev);
	if (ret == 0)
		return PORT_FREE;
	return ret == -EEXIST ? PORT_TAKEN : PORT_FULL;
}

/* nat_create_v4/v6 finds a NAT port for the egress tuple out of the
 * search state (the search of ports.h) and inserts both entries of its
 * pair. The reply (dir 1) entry goes in first: its key holds the remote
 * address and port, so a port is taken only toward that destination.
 * res.addr holds the SNAT address on entry; res is written on success
 * only. On success res holds the mapping and the result is
 * COUNTER_NAT_NEW (or COUNTER_MASQUERADED when another CPU created the
 * same flow concurrently); otherwise the counter of the drop reason:
 * COUNTER_NAT_FULL when the map is full (the caller may drop a pair that
 * is not assured and retry with NAT_CREATE_RETRY, see lib/pressure.h),
 * COUNTER_NO_PORT when the search found none. A global function that takes no pointer but the
 * context, in both builds: the verifier checks it once, not at each of
 * the caller's tries (in the compat build, three times fewer
 * instructions for the egress program). */
__noinline int FAM(nat_create)(struct __sk_buff *skb, __u32 flags)
{
	FAM_T(nat, search) *s;
	FAM_T(nat, val) *cur;
	struct masq_config *cfg;
	int got = PORT_DONE;
	__be16 found;
	__u64 now;
	__u32 i, zero = 0;
	long ret;

	s = bpf_map_lookup_elem(&FAM(nat_search), &zero);
	if (!skb || !s)
		return COUNTER_ERROR;
	cfg = masq_cfg();
	if (!cfg || cfg->port_min == 0 || cfg->port_max < cfg->port_min)
		return COUNTER_NO_PORT;

	now = bpf_ktime_get_ns();
	found = s->in.dport; /* a retry's port: the last search's */
	__builtin_memset(&s->in, 0, sizeof(s->in));
	FAM_ADDR_COPY(s->in.src, s->out.dst);
	FAM_ADDR_COPY(s->in.dst, s->res.addr);
	s->in.sport = s->out.dport;
	s->in.proto = s->out.proto;
	s->in.dir = DIR_INGRESS;
	__builtin_memset(&s->rev, 0, sizeof(s->rev));
	FAM_ADDR_COPY(s->rev.addr, s->out.src);
	s->rev.port = s->out.sport;
	s->rev.handover = NAT_HANDOVER_NONE;
	s->rev.last_seen_ns = now;
	s->rev.created_ns = now;

	if ((flags & NAT_CREATE_RETRY) && found) {
		/* The same flow after an early drop (the caller's retry; this
		 * CPU's search state is as its last create left it, early
		 * drop uses none of it): the port that search found free, its
		 * reply entry refused by the full table only (the insert tells
		 * a key that exists, -EEXIST, before a full map, -E2BIG), goes
		 * in at once: no lookup, no socket lookup again (asked a few
		 * microseconds before), no new walk. Taken meanwhile (another
		 * CPU's flow to the same destination): the walk goes on where
		 * it stopped. */
		s->in.dport = found;
		ret = FAM(nat_insert)(&s->in, &s->rev);
		if (ret == 0)
			got = PORT_FREE;
		else if (ret != -EEXIST)
			return COUNTER_NAT_FULL;
	} else {
		port_walk_init(&s->w, cfg, s->out.proto, flags, s->out.sport);
	}
	for (i = 0; i < PORT_PROBES && got != PORT_FREE; i++) {
		got = FAM(nat_try)(skb);
		if (got != PORT_TAKEN)
			break;
	}
	if (got == PORT_FULL)
		return COUNTER_NAT_FULL;
	if (got != PORT_FREE && got != PORT_REUSED)
		return COUNTER_NO_PORT;
	if (got == PORT_REUSED)
		count(COUNTER_NAT_REUSED);
	cfg = masq_cfg();
	if (cfg && s->in.dport == s->out.sport && keep_port(cfg, s->out.proto, s->out.sport))
		count(COUNTER_NAT_PORT_KEPT);

	/* s->rev becomes the egress entry's value */
	FAM_ADDR_COPY(s->rev.addr, s->in.dst);
	s->rev.port = s->in.dport;
	s->rev.flags = flags & NAT_F_STORED;
	s->rev.last_seen_ns = now;
	s->rev.created_ns = now;
	ret = FAM(nat_insert)(&s->out, &s->rev);
	if (ret == 0) {
		s->res = s->rev;
		/* not assured yet: early drop may take it (evict.h) */
		FAM(nat_cand_note)(&s->in, now);
		return COUNTER_NAT_NEW;
	}
	FAM(nat_delete)(&s->in);
	if (ret != -EEXIST)
		return COUNTER_NAT_FULL;
	/* Lost a race with another CPU translating the same flow: use its pair. */
	cur = bpf_map_lookup_elem(&FAM(nat), &s->out);
	if (!cur)
		return COUNTER_ERROR;
	s->res = *cur;
	return COUNTER_MASQUERADED;
}

/* nat_new_pair_v4/v6 makes the pair of egress tuple out with SNAT address
 * res->addr (nat_create, through the search state): on success *res holds
 * the mapping; on failure *res is unchanged (the caller may make room and
 * retry). Returns nat_create's counter. */
static __always_inline enum counter FAM(nat_new_pair)(struct __sk_buff *skb, const FAM_T(nat, key) *out, __u32 flags,
							FAM_T(nat, val) *res)
{
	FAM_T(nat, search) *s;
	__u32 zero = 0;
	int c;

	s = bpf_map_lookup_elem(&FAM(nat_search), &zero);
	if (!s)
		return COUNTER_ERROR;
	s->out = *out;
	FAM_ADDR_COPY(s->res.addr, res->addr);
	c = FAM(nat_create)(skb, flags);
	if (c == COUNTER_NAT_NEW || c == COUNTER_MASQUERADED)
		*res = s->res;
	return c;
}

#undef FAMILY
#include "family.h"
