//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * ipmasq datapath: source NAT (masquerade) on the node's egress devices.
 *
 * Two tc programs run on every selected egress device (attached with tcx):
 *
 *   ipmasq_egress   decides per new flow whether to masquerade (source in
 *                   masq_src_* or in a masq_rules_* entry for the egress
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
 * recorded in each entry, and the maps are LRU, so a full table evicts its
 * least recently used entries even while the agent is down.
 *
 * Both programs return TC_ACT_UNSPEC so that other tcx programs still run,
 * and TC_ACT_SHOT only when a packet of a flow that must be masqueraded
 * cannot be: the pod address is never sent out.
 *
 * Each program comes in two variants: ipmasq_egress/ipmasq_ingress for
 * Ethernet devices (the network header at ETH_HLEN) and *_l3 for devices
 * without a link-layer header (tun, WireGuard, ipip, ...: the network
 * header at 0). The agent attaches the variant that fits the device's kind.
 */

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <linux/icmpv6.h>
#include <linux/pkt_cls.h>
#include <asm-generic/errno-base.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* linux/icmp.h pulls in libc headers, so the few ICMPv4 constants live here. */
#define ICMP_ECHOREPLY		0
#define ICMP_DEST_UNREACH	3
#define ICMP_ECHO		8
#define ICMP_TIME_EXCEEDED	11
#define ICMP_PARAMETERPROB	12

#define IP_MF		0x2000
#define IP_OFFSET	0x1fff
#define IP6_MF		0x0001
#define IP6_OFFSET	0xfff8

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
/* Extension headers skipped before giving up on an IPv6 packet. */
#define IPV6_MAX_EXT	4
/* last_seen_ns is written at most this often per entry: the collector's
 * timeouts are tens of seconds, and a write per packet would bounce the
 * entry's cache line between CPUs. */
#define NAT_REFRESH_NS	1000000000ULL

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
	COUNTER_NAT_FULL,		/* dropped: NAT table full */
	COUNTER_NO_PORT,		/* dropped: no free NAT port */
	COUNTER_FRAGMENTS,		/* non-first fragments translated (either direction) */
	COUNTER_FRAG_UNKNOWN,		/* dropped: egress non-first fragment of a masqueraded flow without its first fragment */
	COUNTER_ERROR,			/* malformed packets and helper failures */
	COUNTER_NAT_NEW_BY_RULE,	/* new NAT pairs created for a masq_rules_* source (also in COUNTER_NAT_NEW) */
	COUNTER_INBOUND_NEW,		/* inbound flows to a masquerade source recorded (their replies are not translated) */
	COUNTER_SKIP_INBOUND_REPLY,	/* not masqueraded: a reply of an inbound flow */
	COUNTER_SKIP_NOT_FLOW_START,	/* not masqueraded: no NAT pair and the packet does not start a flow (SYN-ACK, RST, mid-stream) */
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
	COUNTER_MAX,
};

/* Exported so that bpf2go emits the enum for Go (-type counter). */
const volatile enum counter counter_max = COUNTER_MAX;

/* BPF_F_IPV6 for bpf_l4_csum_replace on IPv6 pseudo-header changes: without
 * it, kernels before 6.16 corrupt skb->csum of CHECKSUM_COMPLETE packets.
 * The loader clears it on kernels that reject the flag. */
const volatile __u64 csum_ipv6_flag = BPF_F_IPV6;

struct lpm_v4_key {
	__u32 prefixlen;
	__u8 addr[4];
};

struct lpm_v6_key {
	__u32 prefixlen;
	__u8 addr[16];
};

/* A user masquerade rule: masquerade sources in addr/(prefixlen - 32) when
 * they leave through ifindex. prefixlen counts the 32 ifindex bits, which
 * are always matched in full (the kernel compares the key bytes in order):
 * a lookup with prefixlen 64 (v4) or 160 (v6) finds the longest source
 * prefix configured for exactly that device. ifindex is in host byte order. */
struct masq_rule_v4_key {
	__u32 prefixlen;
	__u32 ifindex;
	__u8 addr[4];
};

struct masq_rule_v6_key {
	__u32 prefixlen;
	__u32 ifindex;
	__u8 addr[16];
};

/* The value of both rule maps. has_to: SNAT to the rule's address (to_v4 in
 * masq_rules_v4, to_v6 in masq_rules_v6) rather than the device's. */
struct masq_rule {
	__be32 to_v4;
	__u8 to_v6[16];
	__u8 has_to;
	__u8 pad[3];
};

/* The SNAT address per family of an egress device. */
struct egress_dev {
	__be32 snat_v4;
	__u8 snat_v6[16];
	__u8 has_v4;
	__u8 has_v6;
	__u8 pad[2];
};

/* Connection states, each with its own lifetime (masq_config.timeout_ns).
 * The state of a pair is derived from the flags both directions recorded. */
enum nat_state {
	NAT_TCP_SYN,		/* TCP, not answered yet */
	NAT_TCP_ESTABLISHED,	/* TCP, answered, no FIN or RST */
	NAT_TCP_CLOSING,	/* TCP, a FIN seen (either side) */
	NAT_TCP_RESET,		/* TCP, a RST seen */
	NAT_UDP,		/* UDP, one way so far */
	NAT_UDP_REPLIED,	/* UDP, answered */
	NAT_ICMP,		/* ICMP echo */
	NAT_OTHER,		/* SCTP and address-only pairs (GRE, ESP, ...) */
	NAT_STATE_MAX,
};

/* Exported so that bpf2go emits the enum for Go (-type nat_state). */
const volatile enum nat_state nat_state_max = NAT_STATE_MAX;

/* Host byte order. timeout_ns: idle lifetime per enum nat_state, written by
 * the agent (a zero lifetime never expires a pair here). */
struct masq_config {
	__u16 port_min;
	__u16 port_max;
	__u32 flags;	/* MASQ_CFG_* */
	__u64 timeout_ns[NAT_STATE_MAX];
};

/* masq_config.flags */
#define MASQ_CFG_KEEP_PORT	0x1	/* a TCP/UDP flow keeps its own source port (>= 1024) when free */

struct nat_v4_key {
	__be32 src;
	__be32 dst;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 dir;
	__u8 pad[2];
};

struct nat_v6_key {
	__u8 src[16];
	__u8 dst[16];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 dir;
	__u8 pad[2];
};

/* nat_*_val.flags: what each direction has seen, for lifetimes. */
#define NAT_F_FIN	0x01	/* this direction sent a FIN */
#define NAT_F_RST	0x02	/* this direction sent a RST */
#define NAT_F_SEEN	0x04	/* dir 1 and 2: the answering side has sent a packet */
#define NAT_F_HOST	0x08	/* dir 1: a node flow's tuple, held so no NAT pair takes it */
#define NAT_F_CLOSED_FIRST 0x10	/* dir 0: the source sent the first FIN (the remote holds no TIME_WAIT) */
#define NAT_F_STORED	(NAT_F_FIN | NAT_F_RST | NAT_F_SEEN | NAT_F_HOST | NAT_F_CLOSED_FIRST)
/* pkt.tcp_flags only, never stored. */
#define PKT_F_SYN	0x40
#define PKT_F_ACK	0x80

struct nat_v4_val {
	__be32 addr;
	__be16 port;
	__u8 flags;
	__u8 pad;
	__u64 last_seen_ns;
	__u64 created_ns;
};

struct nat_v6_val {
	__u8 addr[16];
	__be16 port;
	__u8 flags;
	__u8 pad[5];
	__u64 last_seen_ns;
	__u64 created_ns;
};

/* A fragmented datagram in flight: (src, dst, id, proto, dir) -> the address
 * its non-first fragments are translated to. */
struct frag_v4_key {
	__be32 src;
	__be32 dst;
	__be32 id;
	__u8 proto;
	__u8 dir;
	__u8 pad[2];
};

struct frag_v6_key {
	__u8 src[16];
	__u8 dst[16];
	__be32 id;
	__u8 proto;
	__u8 dir;
	__u8 pad[2];
};

struct frag_v4_val {
	__be32 addr;
};

struct frag_v6_val {
	__u8 addr[16];
};

enum {
	DIR_EGRESS = 0,
	DIR_INGRESS = 1,
	/* An inbound flow: a remote opened it toward a masquerade source. Keyed
	 * like dir 0 (the source's reply tuple); its replies leave untranslated. */
	DIR_INBOUND = 2,
};

/* Maps. Sizes are defaults: the loader overrides them (and the nonmasq
 * tries are always replaced by the pinned ones). */

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct lpm_v4_key);
	__type(value, __u8);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} nonmasq_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct lpm_v6_key);
	__type(value, __u8);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} nonmasq_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct lpm_v4_key);
	__type(value, __u8);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} masq_src_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct lpm_v6_key);
	__type(value, __u8);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} masq_src_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct masq_rule_v4_key);
	__type(value, struct masq_rule);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} masq_rules_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct masq_rule_v6_key);
	__type(value, struct masq_rule);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} masq_rules_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __be32);
	__type(value, __u8);
	__uint(max_entries, 1024);
} node_addrs_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u8[16]);
	__type(value, __u8);
	__uint(max_entries, 1024);
} node_addrs_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct egress_dev);
	__uint(max_entries, 256);
} egress_devs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct masq_config);
	__uint(max_entries, 1);
} config SEC(".maps");

/* LRU: a full NAT table admits a new flow by evicting the least recently
 * used entries (as conntrack's early drop does), with or without the agent.
 * Every packet's lookup marks its entry used, so idle pairs go first; a pair
 * that lost one half is repaired or freed by the programs (see
 * nat_established_v4 and nat_reusable_v4). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct nat_v4_key);
	__type(value, struct nat_v4_val);
	__uint(max_entries, 131072);
} nat_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct nat_v6_key);
	__type(value, struct nat_v6_val);
	__uint(max_entries, 131072);
} nat_v6 SEC(".maps");

/* LRU: fragment state needs no collector, a datagram is reassembled (or
 * lost) within seconds. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct frag_v4_key);
	__type(value, struct frag_v4_val);
	__uint(max_entries, 8192);
} frag_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct frag_v6_key);
	__type(value, struct frag_v6_val);
	__uint(max_entries, 8192);
} frag_v6 SEC(".maps");

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

/* ---- Parsing ------------------------------------------------------------ */

enum frag_kind {
	FRAG_NONE,
	FRAG_FIRST,	/* offset 0, more fragments follow: carries the L4 header */
	FRAG_LATER,	/* no L4 header */
};

enum pkt_kind {
	PKT_OTHER,	/* nothing to translate */
	PKT_PORTS,	/* TCP, UDP, ICMP echo request (egress) or reply (ingress) */
	PKT_ICMP_ERR,	/* ICMP error */
	PKT_ECHO_INBOUND, /* ICMP echo of an inbound flow: request (ingress) or reply (egress) */
	PKT_SCTP,	/* SCTP: ports, the NAT port is the pod's (see proto.h) */
	PKT_ADDR,	/* any other protocol, other ICMP types: address-only (proto.h) */
};

/* A parsed packet; addresses in network byte order. */
struct pkt {
	union {
		struct {
			__be32 saddr;
			__be32 daddr;
		} v4;
		struct {
			__u8 saddr[16];
			__u8 daddr[16];
		} v6;
	};
	__u32 l3_off;		/* network header: 0 on L3 devices, ETH_HLEN on Ethernet */
	__u32 l4_off;
	__be32 frag_id;
	__be16 sport;		/* ICMP echo request: the identifier */
	__be16 dport;		/* ICMP echo reply: the identifier */
	__u8 proto;
	__u8 kind;
	__u8 frag;
	__u8 tcp_flags;		/* NAT_F_* */
};

static __always_inline int parse_l3_v4(struct __sk_buff *skb, struct pkt *p)
{
	struct iphdr ip;
	__u16 frag_off;

	if (bpf_skb_load_bytes(skb, p->l3_off, &ip, sizeof(ip)) < 0)
		return -1;
	if (ip.version != 4 || ip.ihl < 5)
		return -1;
	p->v4.saddr = ip.saddr;
	p->v4.daddr = ip.daddr;
	p->proto = ip.protocol;
	p->l4_off = p->l3_off + ip.ihl * 4;
	p->frag_id = ip.id;
	frag_off = bpf_ntohs(ip.frag_off);
	if (frag_off & IP_OFFSET)
		p->frag = FRAG_LATER;
	else if (frag_off & IP_MF)
		p->frag = FRAG_FIRST;
	else
		p->frag = FRAG_NONE;
	return 0;
}

/* parse_l3_v6 walks up to IPV6_MAX_EXT extension headers. It returns 1 for a
 * header chain it does not handle (AH, ESP, too many headers). */
static __always_inline int parse_l3_v6(struct __sk_buff *skb, struct pkt *p)
{
	struct ipv6hdr ip;
	__u32 off = p->l3_off + sizeof(ip);
	__u8 nexthdr;

	if (bpf_skb_load_bytes(skb, p->l3_off, &ip, sizeof(ip)) < 0)
		return -1;
	if (ip.version != 6)
		return -1;
	__builtin_memcpy(p->v6.saddr, &ip.saddr, 16);
	__builtin_memcpy(p->v6.daddr, &ip.daddr, 16);
	p->frag = FRAG_NONE;
	p->frag_id = 0;
	nexthdr = ip.nexthdr;

#pragma unroll
	for (int i = 0; i < IPV6_MAX_EXT; i++) {
		struct {
			__u8 nexthdr;
			__u8 len;
			__be16 frag_off;
			__be32 id;
		} ext;

		switch (nexthdr) {
		case IPPROTO_HOPOPTS:
		case IPPROTO_ROUTING:
		case IPPROTO_DSTOPTS:
			if (bpf_skb_load_bytes(skb, off, &ext, 2) < 0)
				return -1;
			nexthdr = ext.nexthdr;
			off += (ext.len + 1) * 8;
			break;
		case IPPROTO_FRAGMENT:
			if (bpf_skb_load_bytes(skb, off, &ext, sizeof(ext)) < 0)
				return -1;
			nexthdr = ext.nexthdr;
			off += 8;
			p->frag_id = ext.id;
			if (bpf_ntohs(ext.frag_off) & IP6_OFFSET)
				p->frag = FRAG_LATER;
			else if (bpf_ntohs(ext.frag_off) & IP6_MF)
				p->frag = FRAG_FIRST;
			break;
		default:
			goto done;
		}
	}
	switch (nexthdr) {
	case IPPROTO_HOPOPTS:
	case IPPROTO_ROUTING:
	case IPPROTO_DSTOPTS:
	case IPPROTO_FRAGMENT:
		return 1;
	}
done:
	p->proto = nexthdr;
	p->l4_off = off;
	return 0;
}

static __always_inline int is_icmp_error_v4(__u8 type)
{
	return type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED ||
	       type == ICMP_PARAMETERPROB;
}

static __always_inline int is_icmp_error_v6(__u8 type)
{
	return type == ICMPV6_DEST_UNREACH || type == ICMPV6_PKT_TOOBIG ||
	       type == ICMPV6_TIME_EXCEED || type == ICMPV6_PARAMPROB;
}

/* parse_l4 fills ports, TCP flags and the packet kind. It must not be called
 * for non-first fragments. */
static __always_inline int parse_l4(struct __sk_buff *skb, struct pkt *p, int dir)
{
	struct {
		__be16 sport;
		__be16 dport;
		__u32 seq;
		__u32 ack;
		__u8 off;
		__u8 flags;
	} l4;
	__u8 echo_req = p->proto == IPPROTO_ICMP ? ICMP_ECHO : ICMPV6_ECHO_REQUEST;
	__u8 echo_rep = p->proto == IPPROTO_ICMP ? ICMP_ECHOREPLY : ICMPV6_ECHO_REPLY;
	struct {
		__u8 type;
		__u8 code;
		__be16 csum;
		__be16 id;
		__be16 seq;
	} *icmp = (void *)&l4;

	p->kind = PKT_OTHER;
	p->tcp_flags = 0;
	p->sport = 0;
	p->dport = 0;
	switch (p->proto) {
	case IPPROTO_TCP:
		if (bpf_skb_load_bytes(skb, p->l4_off, &l4, sizeof(l4)) < 0)
			return -1;
		p->sport = l4.sport;
		p->dport = l4.dport;
		/* FIN 0x01, SYN 0x02, RST 0x04, ACK 0x10 */
		p->tcp_flags = (l4.flags & 0x01 ? NAT_F_FIN : 0) |
			       (l4.flags & 0x04 ? NAT_F_RST : 0) |
			       (l4.flags & 0x02 ? PKT_F_SYN : 0) |
			       (l4.flags & 0x10 ? PKT_F_ACK : 0);
		p->kind = PKT_PORTS;
		break;
	case IPPROTO_UDP:
		if (bpf_skb_load_bytes(skb, p->l4_off, &l4, 8) < 0)
			return -1;
		p->sport = l4.sport;
		p->dport = l4.dport;
		p->kind = PKT_PORTS;
		break;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		if (bpf_skb_load_bytes(skb, p->l4_off, icmp, 8) < 0)
			return -1;
		if (p->proto == IPPROTO_ICMP ? is_icmp_error_v4(icmp->type)
					     : is_icmp_error_v6(icmp->type)) {
			p->kind = PKT_ICMP_ERR;
		} else if (dir == DIR_EGRESS && icmp->type == echo_req) {
			p->sport = icmp->id;
			p->dport = 0;
			p->kind = PKT_PORTS;
		} else if (dir == DIR_INGRESS && icmp->type == echo_rep) {
			p->sport = 0;
			p->dport = icmp->id;
			p->kind = PKT_PORTS;
		} else if ((dir == DIR_INGRESS && icmp->type == echo_req) ||
			   (dir == DIR_EGRESS && icmp->type == echo_rep)) {
			/* laid out so that the dir-2 key comes out like the
			 * ports': source side id, remote side 0 */
			p->sport = dir == DIR_EGRESS ? icmp->id : 0;
			p->dport = dir == DIR_EGRESS ? 0 : icmp->id;
			p->kind = PKT_ECHO_INBOUND;
		} else {
			/* other types (timestamps, ...): address-only */
			p->kind = PKT_ADDR;
		}
		break;
	case IPPROTO_SCTP:
		if (bpf_skb_load_bytes(skb, p->l4_off, &l4, 4) < 0)
			return -1;
		p->sport = l4.sport;
		p->dport = l4.dport;
		p->kind = PKT_SCTP;
		break;
	default:
		p->kind = PKT_ADDR;
		break;
	}
	return 0;
}

/* Offset of the L4 checksum from the start of the L4 header. */
static __always_inline __u32 l4_csum_off(__u8 proto)
{
	switch (proto) {
	case IPPROTO_TCP:
		return offsetof(struct tcphdr, check);
	case IPPROTO_UDP:
		return offsetof(struct udphdr, check);
	default: /* ICMP, ICMPv6 */
		return 2;
	}
}

/* Offset of the translated port from the start of the L4 header: the source
 * port on egress, the destination port on ingress, the echo identifier. */
static __always_inline __u32 l4_port_off(__u8 proto, int dir)
{
	if (proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6)
		return 4;
	return dir == DIR_EGRESS ? 0 : 2;
}

static __always_inline int addr6_equal(const __u8 *a, const __u8 *b)
{
	__u64 a0, a1, b0, b1;

	__builtin_memcpy(&a0, a, 8);
	__builtin_memcpy(&a1, a + 8, 8);
	__builtin_memcpy(&b0, b, 8);
	__builtin_memcpy(&b1, b + 8, 8);
	return a0 == b0 && a1 == b1;
}

/* ---- Decision ----------------------------------------------------------- */

static __always_inline int is_masq_source_v4(__be32 src)
{
	struct lpm_v4_key k = { .prefixlen = 32 };
	__u8 *v;

	__builtin_memcpy(k.addr, &src, 4);
	v = bpf_map_lookup_elem(&masq_src_v4, &k);
	return v && *v == 1;
}

static __always_inline int is_masq_source_v6(const __u8 *src)
{
	struct lpm_v6_key k = { .prefixlen = 128 };
	__u8 *v;

	__builtin_memcpy(k.addr, src, 16);
	v = bpf_map_lookup_elem(&masq_src_v6, &k);
	return v && *v == 1;
}

/*
 * masq_source_v4/v6 say whether a packet from src leaving through the skb's
 * device is a masquerade candidate: a pod source (masq_src_*, *rule = NULL)
 * or a source with a user rule for this device (*rule = its masq_rules_*
 * entry). Pod sources take one lookup as before; only the others, mostly
 * the host's own traffic, pay for the rule lookup too.
 *
 * The check runs before the NAT lookup of established flows, so that host
 * traffic never pays for one: removing a rule (like removing a pod CIDR)
 * stops translating its flows at once, and their NAT pairs stay until the
 * collector expires them. What decide_* looks at (destination, the rule's
 * toAddress, the device's address) only matters when a flow starts: an
 * established flow keeps the SNAT address it started with.
 */
static __always_inline int masq_source_v4(struct __sk_buff *skb, __be32 src,
					  const struct masq_rule **rule)
{
	struct masq_rule_v4_key k = { .prefixlen = 64, .ifindex = skb->ifindex };

	*rule = NULL;
	if (is_masq_source_v4(src))
		return 1;
	__builtin_memcpy(k.addr, &src, 4);
	*rule = bpf_map_lookup_elem(&masq_rules_v4, &k);
	return *rule != NULL;
}

static __always_inline int masq_source_v6(struct __sk_buff *skb, const __u8 *src,
					  const struct masq_rule **rule)
{
	struct masq_rule_v6_key k = { .prefixlen = 160, .ifindex = skb->ifindex };

	*rule = NULL;
	if (is_masq_source_v6(src))
		return 1;
	__builtin_memcpy(k.addr, src, 16);
	*rule = bpf_map_lookup_elem(&masq_rules_v6, &k);
	return *rule != NULL;
}

/* decide_v4 returns COUNTER_MASQUERADED with the SNAT address, or the counter
 * that says why the packet is left alone. The source was checked already by
 * masq_source_v4, which found rule (NULL for a pod source). The device must
 * be an egress device even when the rule names its own address: the agent
 * writes an entry for every device it attached, with or without addresses. */
/* ---- SNAT address ------------------------------------------------------- */

/*
 * The SNAT address of a new flow is the kernel's own source selection for
 * the route the packet takes through this device (bpf_fib_lookup with
 * BPF_FIB_LOOKUP_SRC, from the source's point of view so ip rules apply):
 * the route's preferred source, else the device's address that fits the
 * next hop (IPv4) or RFC 6724's choice (IPv6), exactly what MASQUERADE
 * asks the kernel for. The pair keeps it for the flow's life. When the
 * lookup finds no route through the device, the device's primary address
 * (egress_devs) is used.
 */

#define AF_INET_	2
#define AF_INET6_	10

/* The lookup's parameters (64 bytes) live in a per-CPU scratch value, not on
 * the stack: the deepest call chains of the programs are near the 512-byte
 * limit already. */
/* Opaque to bpf2go, which cannot express the struct's anonymous unions. */
struct fib_scratch_val {
	__u8 raw[sizeof(struct bpf_fib_lookup)];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct fib_scratch_val);
	__uint(max_entries, 1);
} fib_scratch SEC(".maps");

static __always_inline struct bpf_fib_lookup *fib_params(struct __sk_buff *skb, __u8 family)
{
	__u32 zero = 0;
	struct bpf_fib_lookup *fib = (void *)bpf_map_lookup_elem(&fib_scratch, &zero);

	if (!fib)
		return NULL;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = family;
	fib->ifindex = skb->ifindex;
	return fib;
}

#define FIB_SOURCE_FLAGS (BPF_FIB_LOOKUP_OUTPUT | BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH)

/* fib_source_v4 returns 1 with *snat set, 0 when the kernel has no route
 * through this device, -1 when it has one but no source address for it. */
static __always_inline int fib_source_v4(struct __sk_buff *skb, __be32 src, __be32 dst, __be32 *snat)
{
	struct bpf_fib_lookup *fib = fib_params(skb, AF_INET_);
	long ret;

	if (!fib)
		return 0;
	fib->ipv4_src = src;
	fib->ipv4_dst = dst;
	ret = bpf_fib_lookup(skb, fib, sizeof(*fib), FIB_SOURCE_FLAGS);
	if (ret == BPF_FIB_LKUP_RET_SUCCESS && fib->ifindex == skb->ifindex && fib->ipv4_src) {
		*snat = fib->ipv4_src;
		return 1;
	}
	return ret == BPF_FIB_LKUP_RET_NO_SRC_ADDR ? -1 : 0;
}

static __always_inline int fib_source_v6(struct __sk_buff *skb, const struct pkt *p, __u8 *snat)
{
	struct bpf_fib_lookup *fib = fib_params(skb, AF_INET6_);
	long ret;

	if (!fib)
		return 0;
	__builtin_memcpy(fib->ipv6_src, p->v6.saddr, 16);
	__builtin_memcpy(fib->ipv6_dst, p->v6.daddr, 16);
	ret = bpf_fib_lookup(skb, fib, sizeof(*fib), FIB_SOURCE_FLAGS);
	if (ret == BPF_FIB_LKUP_RET_SUCCESS && fib->ifindex == skb->ifindex) {
		__builtin_memcpy(snat, fib->ipv6_src, 16);
		return 1;
	}
	return ret == BPF_FIB_LKUP_RET_NO_SRC_ADDR ? -1 : 0;
}

static __always_inline enum counter decide_v4(struct __sk_buff *skb, __be32 src, __be32 dst,
					      const struct masq_rule *rule, __be32 *snat)
{
	struct lpm_v4_key k = { .prefixlen = 32 };
	struct egress_dev *dev;
	__u32 ifindex = skb->ifindex;
	__u8 *action;

	if (bpf_map_lookup_elem(&node_addrs_v4, &dst))
		return COUNTER_SKIP_NODE_DST;
	__builtin_memcpy(k.addr, &dst, 4);
	/* Longest prefix wins: a masqueradeCIDRs entry (action 1) inside a
	 * non-masquerade range is masqueraded. */
	action = bpf_map_lookup_elem(&nonmasq_v4, &k);
	if (action && *action == 0)
		return COUNTER_SKIP_NONMASQ_DST;
	dev = bpf_map_lookup_elem(&egress_devs, &ifindex);
	if (!dev)
		return COUNTER_SKIP_NO_SNAT_ADDR;
	if (rule && rule->has_to) {
		*snat = rule->to_v4;
		return COUNTER_MASQUERADED;
	}
	switch (fib_source_v4(skb, src, dst, snat)) {
	case 1:
		return COUNTER_MASQUERADED;
	case -1:
		return COUNTER_DROP_NO_SNAT_ADDR;
	}
	if (!dev->has_v4)
		return COUNTER_DROP_NO_SNAT_ADDR;
	*snat = dev->snat_v4;
	return COUNTER_MASQUERADED;
}

/* decide_v6 is decide_v4 for IPv6. */
static __always_inline enum counter decide_v6(struct __sk_buff *skb, const struct pkt *p,
					      const struct masq_rule *rule, __u8 *snat)
{
	const __u8 *dst = p->v6.daddr;
	struct lpm_v6_key k = { .prefixlen = 128 };
	struct egress_dev *dev;
	__u32 ifindex = skb->ifindex;
	__u8 *action;

	__builtin_memcpy(k.addr, dst, 16);
	if (bpf_map_lookup_elem(&node_addrs_v6, k.addr))
		return COUNTER_SKIP_NODE_DST;
	action = bpf_map_lookup_elem(&nonmasq_v6, &k);
	if (action && *action == 0)
		return COUNTER_SKIP_NONMASQ_DST;
	dev = bpf_map_lookup_elem(&egress_devs, &ifindex);
	if (!dev)
		return COUNTER_SKIP_NO_SNAT_ADDR;
	if (rule && rule->has_to) {
		__builtin_memcpy(snat, rule->to_v6, 16);
		return COUNTER_MASQUERADED;
	}
	switch (fib_source_v6(skb, p, snat)) {
	case 1:
		return COUNTER_MASQUERADED;
	case -1:
		return COUNTER_DROP_NO_SNAT_ADDR;
	}
	if (!dev->has_v6)
		return COUNTER_DROP_NO_SNAT_ADDR;
	__builtin_memcpy(snat, dev->snat_v6, 16);
	return COUNTER_MASQUERADED;
}

/* ---- NAT state and port allocation -------------------------------------- */

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

/* ---- Flow state and lifetimes --------------------------------------------- */

/*
 * Like conntrack, a pair lives as long as its state allows without a packet:
 * an unanswered SYN briefly, an established TCP flow long, a closing or reset
 * one briefly again. The state is derived from the flags both directions
 * recorded (FIN and RST per direction, SEEN once the remote answered). The
 * programs apply the lifetimes themselves, when a SYN meets an old pair and
 * when a NAT port is wanted, so that nothing waits for the agent's collector
 * (which only frees the memory of expired pairs, and may be down).
 */

/* A closed TCP pair's port goes to a new flow of the same source only after
 * this long since the pair closed (the FIN or RST stamps last_seen_ns at
 * once), so the last ACK of the old connection still finds its pair. */
#define NAT_CLOSED_LINGER_NS	2000000000ULL

/* flow_start says whether p may start a flow in direction dir: a SYN without
 * ACK, any UDP datagram, an ICMP echo request. */
static __always_inline int flow_start(const struct pkt *p, int dir)
{
	switch (p->proto) {
	case IPPROTO_TCP:
		return (p->tcp_flags & (PKT_F_SYN | PKT_F_ACK)) == PKT_F_SYN;
	case IPPROTO_UDP:
		return 1;
	}
	/* egress PKT_PORTS: echo request; ingress PKT_ECHO_INBOUND: echo request */
	return dir == DIR_EGRESS ? p->kind == PKT_PORTS : p->kind == PKT_ECHO_INBOUND;
}

static __always_inline int tcp_syn(const struct pkt *p)
{
	return p->proto == IPPROTO_TCP && flow_start(p, DIR_EGRESS);
}

/* nat_state is the state of a pair from the flags of both its directions. */
static __always_inline __u32 nat_state(__u8 proto, __u8 flags)
{
	switch (proto) {
	case IPPROTO_TCP:
		if (flags & NAT_F_RST)
			return NAT_TCP_RESET;
		if (flags & NAT_F_FIN)
			return NAT_TCP_CLOSING;
		return flags & NAT_F_SEEN ? NAT_TCP_ESTABLISHED : NAT_TCP_SYN;
	case IPPROTO_UDP:
		return flags & NAT_F_SEEN ? NAT_UDP_REPLIED : NAT_UDP;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		return NAT_ICMP;
	}
	return NAT_OTHER;
}

/* nat_expired says whether a pair last seen at last has outlived its state. */
static __always_inline int nat_expired(const struct masq_config *cfg, __u8 proto, __u8 flags,
				       __u64 last, __u64 now)
{
	__u32 state = nat_state(proto, flags);
	__u64 lifetime;

	if (state >= NAT_STATE_MAX)
		return 0;
	lifetime = cfg->timeout_ns[state];
	return lifetime && now > last && now - last > lifetime;
}

/* nat_closed: both sides sent a FIN, or one a RST (out: the source's side's
 * flags, in: the remote's). */
static __always_inline int nat_closed(__u8 out, __u8 in)
{
	return ((out | in) & NAT_F_RST) || ((out & in) & NAT_F_FIN);
}

static __always_inline struct masq_config *masq_cfg(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&config, &zero);
}

static __always_inline void nat_touch_v4(struct nat_v4_val *v, __u8 flags)
{
	__u64 now = bpf_ktime_get_ns();

	/* A new flag (a FIN or RST: the pair is closing) stamps the time at
	 * once, so a closed pair's linger counts from its close. */
	if (flags & ~v->flags) {
		v->flags |= flags;
		v->last_seen_ns = now;
		return;
	}
	if (now - v->last_seen_ns > NAT_REFRESH_NS)
		v->last_seen_ns = now;
}

static __always_inline void nat_touch_v6(struct nat_v6_val *v, __u8 flags)
{
	__u64 now = bpf_ktime_get_ns();

	/* A new flag (a FIN or RST: the pair is closing) stamps the time at
	 * once, so a closed pair's linger counts from its close. */
	if (flags & ~v->flags) {
		v->flags |= flags;
		v->last_seen_ns = now;
		return;
	}
	if (now - v->last_seen_ns > NAT_REFRESH_NS)
		v->last_seen_ns = now;
}

/* Restart an entry's life as a new flow's (a reopened pair). */
#define NAT_RESET(v, now) do {		\
	(v)->flags = 0;			\
	(v)->created_ns = (now);	\
	(v)->last_seen_ns = (now);	\
} while (0)

/* nat_pair_v4 is the key of the other direction of an entry (dir 0 <-> 1). */
static __always_inline void nat_pair_v4(const struct nat_v4_key *k, const struct nat_v4_val *v,
					struct nat_v4_key *peer)
{
	__builtin_memset(peer, 0, sizeof(*peer));
	peer->proto = k->proto;
	if (k->dir == DIR_EGRESS) {
		peer->src = k->dst;
		peer->dst = v->addr;
		peer->sport = k->dport;
		peer->dport = v->port;
		peer->dir = DIR_INGRESS;
	} else {
		peer->src = v->addr;
		peer->dst = k->src;
		peer->sport = v->port;
		peer->dport = k->sport;
		peer->dir = DIR_EGRESS;
	}
}

static __always_inline void nat_pair_v6(const struct nat_v6_key *k, const struct nat_v6_val *v,
					struct nat_v6_key *peer)
{
	__builtin_memset(peer, 0, sizeof(*peer));
	peer->proto = k->proto;
	if (k->dir == DIR_EGRESS) {
		__builtin_memcpy(peer->src, k->dst, 16);
		__builtin_memcpy(peer->dst, v->addr, 16);
		peer->sport = k->dport;
		peer->dport = v->port;
		peer->dir = DIR_INGRESS;
	} else {
		__builtin_memcpy(peer->src, v->addr, 16);
		__builtin_memcpy(peer->dst, k->src, 16);
		peer->sport = v->port;
		peer->dport = k->sport;
		peer->dir = DIR_EGRESS;
	}
}

/* nat_established_v4 handles an egress packet of a pair whose dir-0 entry v
 * exists. Cheap for most packets; once a second per pair, and for every SYN,
 * it checks the reply entry: one lost (LRU eviction) is put back, one taken
 * by another flow ends this pair (returns 1: the caller treats the packet
 * as having no pair). A SYN on a closed or expired pair reopens it. */
__noinline int nat_established_v4(const struct nat_v4_key *k, struct nat_v4_val *v,
				   const struct pkt *p)
{
	struct masq_config *cfg;
	__u8 flags;
	struct nat_v4_key peer;
	struct nat_v4_val *r, nr = {};
	__u64 now = bpf_ktime_get_ns();

	if (!k || !v || !p)
		return 0;
	flags = p->tcp_flags & (NAT_F_FIN | NAT_F_RST);
	/* A new FIN or RST takes the slow path: the first FIN needs the reply
	 * entry's flags to tell who closed first. */
	if (!tcp_syn(p) && !(flags & ~v->flags) && now - v->last_seen_ns <= NAT_REFRESH_NS)
		return 0;
	nat_pair_v4(k, v, &peer);
	r = bpf_map_lookup_elem(&nat_v4, &peer);
	if (!r) {
		nr.addr = k->src;
		nr.port = k->sport;
		nr.last_seen_ns = now;
		nr.created_ns = v->created_ns;
		if (bpf_map_update_elem(&nat_v4, &peer, &nr, BPF_NOEXIST) == 0) {
			nat_touch_v4(v, flags);
			return 0;
		}
		r = bpf_map_lookup_elem(&nat_v4, &peer);
		if (!r)
			return 0;
	}
	if (r->addr != k->src || r->port != k->sport) {
		bpf_map_delete_elem(&nat_v4, k);
		return 1;
	}
	cfg = masq_cfg();
	if (tcp_syn(p) && cfg &&
	    (nat_closed(v->flags, r->flags) ||
	     nat_expired(cfg, k->proto, v->flags | r->flags, v->last_seen_ns > r->last_seen_ns ?
			 v->last_seen_ns : r->last_seen_ns, now))) {
		NAT_RESET(v, now);
		NAT_RESET(r, now);
		count(COUNTER_NAT_REOPENED);
		return 0;
	}
	/* The source's FIN before any from the remote: the remote closes
	 * passively and keeps no TIME_WAIT for this tuple. */
	if ((flags & NAT_F_FIN) && !(v->flags & NAT_F_FIN) && !((r->flags | v->flags) & NAT_F_RST) &&
	    !(r->flags & NAT_F_FIN))
		flags |= NAT_F_CLOSED_FIRST;
	nat_touch_v4(v, flags);
	return 0;
}

__noinline int nat_established_v6(const struct nat_v6_key *k, struct nat_v6_val *v,
				   const struct pkt *p)
{
	struct masq_config *cfg;
	__u8 flags;
	struct nat_v6_key peer;
	struct nat_v6_val *r, nr = {};
	__u64 now = bpf_ktime_get_ns();

	if (!k || !v || !p)
		return 0;
	flags = p->tcp_flags & (NAT_F_FIN | NAT_F_RST);
	/* A new FIN or RST takes the slow path: the first FIN needs the reply
	 * entry's flags to tell who closed first. */
	if (!tcp_syn(p) && !(flags & ~v->flags) && now - v->last_seen_ns <= NAT_REFRESH_NS)
		return 0;
	nat_pair_v6(k, v, &peer);
	r = bpf_map_lookup_elem(&nat_v6, &peer);
	if (!r) {
		__builtin_memcpy(nr.addr, k->src, 16);
		nr.port = k->sport;
		nr.last_seen_ns = now;
		nr.created_ns = v->created_ns;
		if (bpf_map_update_elem(&nat_v6, &peer, &nr, BPF_NOEXIST) == 0) {
			nat_touch_v6(v, flags);
			return 0;
		}
		r = bpf_map_lookup_elem(&nat_v6, &peer);
		if (!r)
			return 0;
	}
	if (!addr6_equal(r->addr, k->src) || r->port != k->sport) {
		bpf_map_delete_elem(&nat_v6, k);
		return 1;
	}
	cfg = masq_cfg();
	if (tcp_syn(p) && cfg &&
	    (nat_closed(v->flags, r->flags) ||
	     nat_expired(cfg, k->proto, v->flags | r->flags, v->last_seen_ns > r->last_seen_ns ?
			 v->last_seen_ns : r->last_seen_ns, now))) {
		NAT_RESET(v, now);
		NAT_RESET(r, now);
		count(COUNTER_NAT_REOPENED);
		return 0;
	}
	/* The source's FIN before any from the remote: the remote closes
	 * passively and keeps no TIME_WAIT for this tuple. */
	if ((flags & NAT_F_FIN) && !(v->flags & NAT_F_FIN) && !((r->flags | v->flags) & NAT_F_RST) &&
	    !(r->flags & NAT_F_FIN))
		flags |= NAT_F_CLOSED_FIRST;
	nat_touch_v6(v, flags);
	return 0;
}

/* nat_reusable_v4 says whether the NAT tuple in (a dir-1 key that exists)
 * may be given to a new flow from src: its pair expired, lost its other
 * half, or is a closed TCP pair (2 s after its close) of the same source
 * address (whose TCP timestamps keep increasing toward this server, so the
 * server's TIME_WAIT socket accepts the new SYN: no PAWS drop) or whose
 * source closed first (the server closed passively: no TIME_WAIT to
 * refuse another source's SYN). The old dir-0 entry is deleted. */
__noinline int nat_reusable_v4(const struct nat_v4_key *in, __be32 src, __u64 now)
{
	struct masq_config *cfg = masq_cfg();
	struct nat_v4_key peer;
	struct nat_v4_val *r, *o;
	__u64 last;

	if (!in || !cfg)
		return 0;
	r = bpf_map_lookup_elem(&nat_v4, in);
	if (!r)
		return 1;
	if (r->flags & NAT_F_HOST)
		return nat_expired(cfg, in->proto, r->flags, r->last_seen_ns, now);
	nat_pair_v4(in, r, &peer);
	o = bpf_map_lookup_elem(&nat_v4, &peer);
	if (!o || o->addr != in->dst || o->port != in->dport)
		/* half a pair: reusable unless another CPU is creating it */
		return now - r->created_ns > NAT_REFRESH_NS;
	last = o->last_seen_ns > r->last_seen_ns ? o->last_seen_ns : r->last_seen_ns;
	if (nat_expired(cfg, in->proto, o->flags | r->flags, last, now) ||
	    (in->proto == IPPROTO_TCP && (r->addr == src || (o->flags & NAT_F_CLOSED_FIRST)) &&
	     nat_closed(o->flags, r->flags) && now - last > NAT_CLOSED_LINGER_NS)) {
		bpf_map_delete_elem(&nat_v4, &peer);
		return 1;
	}
	return 0;
}

/* Inlined into nat_create_v6: a call of its own would take the IPv6 egress
 * path's stack over 512 bytes. */
static __always_inline int nat_reusable_v6(const struct nat_v6_key *in, const struct nat_v6_key *out,
					   __u64 now)
{
	struct masq_config *cfg = masq_cfg();
	struct nat_v6_key peer;
	struct nat_v6_val *r, *o;
	__u64 last;

	if (!in || !out || !cfg)
		return 0;
	r = bpf_map_lookup_elem(&nat_v6, in);
	if (!r)
		return 1;
	if (r->flags & NAT_F_HOST)
		return nat_expired(cfg, in->proto, r->flags, r->last_seen_ns, now);
	nat_pair_v6(in, r, &peer);
	o = bpf_map_lookup_elem(&nat_v6, &peer);
	if (!o || !addr6_equal(o->addr, in->dst) || o->port != in->dport)
		return now - r->created_ns > NAT_REFRESH_NS;
	last = o->last_seen_ns > r->last_seen_ns ? o->last_seen_ns : r->last_seen_ns;
	if (nat_expired(cfg, in->proto, o->flags | r->flags, last, now) ||
	    (in->proto == IPPROTO_TCP && (addr6_equal(r->addr, out->src) || (o->flags & NAT_F_CLOSED_FIRST)) &&
	     nat_closed(o->flags, r->flags) && now - last > NAT_CLOSED_LINGER_NS)) {
		bpf_map_delete_elem(&nat_v6, &peer);
		return 1;
	}
	return 0;
}

/* ---- Inbound flows ------------------------------------------------------ */

/*
 * A flow a remote opens toward a masquerade source (a pod reachable by
 * routing: BGP, a load balancer with IP targets) must be answered from the
 * pod's own address: Linux never translates the replies of a connection it
 * did not masquerade. The ingress program records such a flow (dir 2, keyed
 * by the pod's reply tuple) when its first packet arrives; on egress, a
 * packet without a NAT pair that matches a record passes untranslated.
 */

static __always_inline void inbound_key_v4(const struct pkt *p, int dir, struct nat_v4_key *k)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->proto = p->proto;
	k->dir = DIR_INBOUND;
	if (dir == DIR_EGRESS) {
		k->src = p->v4.saddr;
		k->dst = p->v4.daddr;
		k->sport = p->sport;
		k->dport = p->dport;
	} else {
		k->src = p->v4.daddr;
		k->dst = p->v4.saddr;
		k->sport = p->dport;
		k->dport = p->sport;
	}
}

static __always_inline void inbound_key_v6(const struct pkt *p, int dir, struct nat_v6_key *k)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->proto = p->proto;
	k->dir = DIR_INBOUND;
	if (dir == DIR_EGRESS) {
		__builtin_memcpy(k->src, p->v6.saddr, 16);
		__builtin_memcpy(k->dst, p->v6.daddr, 16);
		k->sport = p->sport;
		k->dport = p->dport;
	} else {
		__builtin_memcpy(k->src, p->v6.daddr, 16);
		__builtin_memcpy(k->dst, p->v6.saddr, 16);
		k->sport = p->dport;
		k->dport = p->sport;
	}
}

/* inbound_track_v4 records (or refreshes, or reopens) the inbound flow of an
 * ingress packet that matched no NAT pair. Mid-stream TCP segments cost
 * nothing: only SYN, FIN and RST are looked at. */
static __always_inline void inbound_track_v4(struct __sk_buff *skb, const struct pkt *p)
{
	const struct masq_rule *rule;
	struct nat_v4_val *v, nv = {};
	struct masq_config *cfg;
	struct nat_v4_key k;
	__u64 now;

	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & (PKT_F_SYN | NAT_F_FIN | NAT_F_RST)))
		return;
	if (!masq_source_v4(skb, p->v4.daddr, &rule))
		return;
	inbound_key_v4(p, DIR_INGRESS, &k);
	now = bpf_ktime_get_ns();
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (v) {
		cfg = masq_cfg();
		if (p->proto == IPPROTO_TCP && flow_start(p, DIR_INGRESS) && cfg &&
		    (v->flags & (NAT_F_FIN | NAT_F_RST) ||
		     nat_expired(cfg, k.proto, v->flags, v->last_seen_ns, now))) {
			NAT_RESET(v, now);
			return;
		}
		nat_touch_v4(v, p->tcp_flags & (NAT_F_FIN | NAT_F_RST));
		return;
	}
	if (!flow_start(p, DIR_INGRESS))
		return;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (bpf_map_update_elem(&nat_v4, &k, &nv, BPF_NOEXIST) == 0)
		count(COUNTER_INBOUND_NEW);
}

static __always_inline void inbound_track_v6(struct __sk_buff *skb, const struct pkt *p)
{
	const struct masq_rule *rule;
	struct nat_v6_val *v, nv = {};
	struct masq_config *cfg;
	struct nat_v6_key k;
	__u64 now;

	if (p->proto == IPPROTO_TCP && !(p->tcp_flags & (PKT_F_SYN | NAT_F_FIN | NAT_F_RST)))
		return;
	if (!masq_source_v6(skb, p->v6.daddr, &rule))
		return;
	inbound_key_v6(p, DIR_INGRESS, &k);
	now = bpf_ktime_get_ns();
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (v) {
		cfg = masq_cfg();
		if (p->proto == IPPROTO_TCP && flow_start(p, DIR_INGRESS) && cfg &&
		    (v->flags & (NAT_F_FIN | NAT_F_RST) ||
		     nat_expired(cfg, k.proto, v->flags, v->last_seen_ns, now))) {
			NAT_RESET(v, now);
			return;
		}
		nat_touch_v6(v, p->tcp_flags & (NAT_F_FIN | NAT_F_RST));
		return;
	}
	if (!flow_start(p, DIR_INGRESS))
		return;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (bpf_map_update_elem(&nat_v6, &k, &nv, BPF_NOEXIST) == 0)
		count(COUNTER_INBOUND_NEW);
}

/* inbound_reply_v4 says whether an egress packet without a NAT pair answers
 * a recorded inbound flow (and refreshes the record). */
static __always_inline int inbound_reply_v4(const struct pkt *p)
{
	struct nat_v4_val *v;
	struct nat_v4_key k;

	inbound_key_v4(p, DIR_EGRESS, &k);
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (!v)
		return 0;
	nat_touch_v4(v, (p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	return 1;
}

static __always_inline int inbound_reply_v6(const struct pkt *p)
{
	struct nat_v6_val *v;
	struct nat_v6_key k;

	inbound_key_v6(p, DIR_EGRESS, &k);
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (!v)
		return 0;
	nat_touch_v6(v, (p->tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	return 1;
}

/* egress_no_pair sorts an egress packet from a masquerade source that has no
 * NAT pair: a reply of an inbound flow or a packet that cannot start a flow
 * passes untranslated (a NAT pair is only ever made by a flow's first
 * packet); 0 means "decide and create a pair". */
static __always_inline int egress_no_pair(const struct pkt *p, int is_v6)
{
	if (is_v6 ? inbound_reply_v6(p) : inbound_reply_v4(p)) {
		count(COUNTER_SKIP_INBOUND_REPLY);
		return 1;
	}
	if (!flow_start(p, DIR_EGRESS)) {
		count(COUNTER_SKIP_NOT_FLOW_START);
		return 1;
	}
	return 0;
}

/* ---- The node's own flows ---------------------------------------------- */

/*
 * A node socket may bind a port of the NAT range by itself (resolvers that
 * pick random ports do; the kernel's automatic choice avoids the range,
 * which the agent reserves). Like nf_nat_used_tuple, a node flow toward a
 * remote holds its reply tuple in the NAT map (a dir-1 entry marked
 * NAT_F_HOST, created by the flow's first packet), so no NAT pair takes
 * that port toward that remote, and its replies pass the ingress program
 * untouched. The entry lives by the flow's state, refreshed by its replies
 * (the ingress lookup happens anyway) and its first packets.
 *
 * Ports outside the range are not reserved: a pod keeps its own port there
 * only where no node socket holds the tuple (node_socket_v4), but the
 * node's kernel may choose that port later for a connection to the same
 * remote. Such a node flow gets a NAT pair of its own (a port of the range,
 * same address), as conntrack remaps a clashing tuple; its packets then
 * find their dir-0 entry like a pod's. Every node TCP/UDP packet costs one
 * lookup of that entry; only flow starts look further.
 */

/* host_flow_* results. */
#define HOST_PASS	0	/* leaves untouched */
#define HOST_PAIR	1	/* has a NAT pair, or needs one: translated like a pod's flow */

__noinline int host_flow_v4(struct __sk_buff *skb, struct pkt *p)
{
	struct nat_v4_key k = { .dir = DIR_EGRESS };
	struct nat_v4_val *v, nv = { .flags = NAT_F_HOST };
	struct masq_config *cfg = masq_cfg();
	__u16 port;
	__u64 now;

	if (!skb || !p || !cfg || p->frag == FRAG_LATER)
		return HOST_PASS;
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return HOST_PASS;
	if (!bpf_map_lookup_elem(&node_addrs_v4, &p->v4.saddr))
		return HOST_PASS;
	if (parse_l4(skb, p, DIR_EGRESS) < 0)
		return HOST_PASS;
	k.src = p->v4.saddr;
	k.dst = p->v4.daddr;
	k.sport = p->sport;
	k.dport = p->dport;
	k.proto = p->proto;
	if (bpf_map_lookup_elem(&nat_v4, &k))
		return HOST_PAIR; /* given another port when it started */
	if (!flow_start(p, DIR_EGRESS))
		return HOST_PASS;
	k.src = p->v4.daddr;
	k.dst = p->v4.saddr;
	k.sport = p->dport;
	k.dport = p->sport;
	k.dir = DIR_INGRESS;
	now = bpf_ktime_get_ns();
	port = bpf_ntohs(p->sport);
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (v) {
		if (v->flags & NAT_F_HOST) {
			nat_touch_v4(v, 0);
			return HOST_PASS;
		}
		/* A translated flow holds the tuple (a pod kept this port, which
		 * the node's kernel then chose too): the node's flow gets a port
		 * of the range, as conntrack remaps a clashing tuple. */
		if (!nat_reusable_v4(&k, p->v4.saddr, now))
			return HOST_PAIR;
	}
	if (port < cfg->port_min || port > cfg->port_max) {
		/* A pair that is over must not catch the node's replies. */
		if (v)
			bpf_map_delete_elem(&nat_v4, &k);
		return HOST_PASS;
	}
	nv.addr = p->v4.saddr;
	nv.port = p->sport;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (bpf_map_update_elem(&nat_v4, &k, &nv, v ? BPF_ANY : BPF_NOEXIST) == 0)
		count(COUNTER_HOST_FLOW_NEW);
	return HOST_PASS;
}

__noinline int host_flow_v6(struct __sk_buff *skb, struct pkt *p)
{
	struct nat_v6_key k = { .dir = DIR_EGRESS }, out;
	struct nat_v6_val *v, nv = { .flags = NAT_F_HOST };
	struct masq_config *cfg = masq_cfg();
	__u16 port;
	__u64 now;

	if (!skb || !p || !cfg || p->frag == FRAG_LATER)
		return HOST_PASS;
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return HOST_PASS;
	if (!bpf_map_lookup_elem(&node_addrs_v6, p->v6.saddr))
		return HOST_PASS;
	if (parse_l4(skb, p, DIR_EGRESS) < 0)
		return HOST_PASS;
	__builtin_memcpy(k.src, p->v6.saddr, 16);
	__builtin_memcpy(k.dst, p->v6.daddr, 16);
	k.sport = p->sport;
	k.dport = p->dport;
	k.proto = p->proto;
	if (bpf_map_lookup_elem(&nat_v6, &k))
		return HOST_PAIR; /* given another port when it started */
	if (!flow_start(p, DIR_EGRESS))
		return HOST_PASS;
	out = k;
	__builtin_memcpy(k.src, p->v6.daddr, 16);
	__builtin_memcpy(k.dst, p->v6.saddr, 16);
	k.sport = p->dport;
	k.dport = p->sport;
	k.dir = DIR_INGRESS;
	now = bpf_ktime_get_ns();
	port = bpf_ntohs(p->sport);
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (v) {
		if (v->flags & NAT_F_HOST) {
			nat_touch_v6(v, 0);
			return HOST_PASS;
		}
		/* See host_flow_v4. */
		if (!nat_reusable_v6(&k, &out, now))
			return HOST_PAIR;
	}
	if (port < cfg->port_min || port > cfg->port_max) {
		if (v)
			bpf_map_delete_elem(&nat_v6, &k);
		return HOST_PASS;
	}
	__builtin_memcpy(nv.addr, p->v6.saddr, 16);
	nv.port = p->sport;
	nv.last_seen_ns = now;
	nv.created_ns = now;
	if (bpf_map_update_elem(&nat_v6, &k, &nv, v ? BPF_ANY : BPF_NOEXIST) == 0)
		count(COUNTER_HOST_FLOW_NEW);
	return HOST_PASS;
}

/* ---- NAT port allocation ------------------------------------------------ */

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
 * otherwise the counter of the drop reason. */
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
		if (candidate_reuses(i) && nat_reusable_v4(&in, out->src, now) &&
		    bpf_map_update_elem(&nat_v4, &in, &rev, BPF_ANY) == 0) {
			count(COUNTER_NAT_REUSED);
			goto found;
		}
	}
	return COUNTER_NO_PORT;

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
 * on entry (a global function's pointer must point to a whole struct). */
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
		if (ret != -EEXIST)
			return COUNTER_NAT_FULL;
		if (candidate_reuses(i) && nat_reusable_v6(&in, out, now) &&
		    bpf_map_update_elem(&nat_v6, &in, res, BPF_ANY) == 0) {
			count(COUNTER_NAT_REUSED);
			goto found;
		}
	}
	return COUNTER_NO_PORT;

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

/* ---- Rewriting ---------------------------------------------------------- */

/*
 * The checksum helpers are used so that they stay right for every
 * skb->ip_summed: a changed address goes through bpf_l4_csum_replace with
 * BPF_F_PSEUDO_HDR (for CHECKSUM_PARTIAL only the pseudo-header sum in the
 * checksum field is updated), a changed port without it (ignored for
 * CHECKSUM_PARTIAL, the device sums the payload later). UDP uses
 * BPF_F_MARK_MANGLED_0 so that a zero "no checksum" stays zero and a computed
 * zero becomes 0xffff.
 */

/* rewrite_v4 replaces the address at addr_off (source or destination) and,
 * when port_off is non-zero, the port or echo identifier at port_off, fixing
 * the IPv4 header checksum and the L4 checksum at csum_off (0: this packet
 * carries no L4 header, a non-first fragment). */
static __always_inline int rewrite_v4(struct __sk_buff *skb, __u32 l3_off, __u32 addr_off,
				      __be32 from, __be32 to,
				      __u8 proto, __u32 csum_off, __u32 port_off,
				      __be16 pfrom, __be16 pto)
{
	__u64 mangled = proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;

	if (csum_off) {
		/* ICMPv4 has no pseudo header. */
		if (proto != IPPROTO_ICMP &&
		    bpf_l4_csum_replace(skb, csum_off, from, to, BPF_F_PSEUDO_HDR | mangled | 4) < 0)
			return -1;
		if (pfrom != pto) {
			if (bpf_l4_csum_replace(skb, csum_off, pfrom, pto, mangled | 2) < 0)
				return -1;
			if (bpf_skb_store_bytes(skb, port_off, &pto, 2, 0) < 0)
				return -1;
		}
	}
	if (bpf_l3_csum_replace(skb, l3_off + offsetof(struct iphdr, check), from, to, 4) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, addr_off, &to, 4, 0) < 0)
		return -1;
	return 0;
}

/* rewrite_v6 is rewrite_v4 for IPv6: no header checksum, and ICMPv6 does
 * have a pseudo header. from and to point to 16-byte stack copies. */
static __always_inline int rewrite_v6(struct __sk_buff *skb, __u32 addr_off, __u8 *from, __u8 *to,
				      __u8 proto, __u32 csum_off, __u32 port_off,
				      __be16 pfrom, __be16 pto)
{
	__u64 mangled = proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;

	if (csum_off) {
		__s64 diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);

		if (bpf_l4_csum_replace(skb, csum_off, 0, (__u32)diff,
					BPF_F_PSEUDO_HDR | csum_ipv6_flag | mangled) < 0)
			return -1;
		if (pfrom != pto) {
			if (bpf_l4_csum_replace(skb, csum_off, pfrom, pto, mangled | 2) < 0)
				return -1;
			if (bpf_skb_store_bytes(skb, port_off, &pto, 2, 0) < 0)
				return -1;
		}
	}
	if (bpf_skb_store_bytes(skb, addr_off, to, 16, 0) < 0)
		return -1;
	return 0;
}

/* ---- Fragments ---------------------------------------------------------- */

/*
 * Fragments (IPv4 MF/offset, IPv6 fragment header): the first fragment holds
 * the L4 header and is translated like any packet of its flow, ports and L4
 * checksum included (the checksum covers the whole datagram, and the update
 * is a delta). It also records (src, dst, id, proto, dir) -> translated
 * address in frag_v4/frag_v6, and the later fragments get the L3 rewrite
 * only. A later fragment with no record (reordered before its first, or the
 * record evicted) is dropped on egress when its flow would be masqueraded,
 * so the pod address never leaves, and passed untouched on ingress.
 */

static __always_inline void frag_remember_v4(const struct pkt *p, int dir, __be32 to)
{
	struct frag_v4_key k = {
		.src = p->v4.saddr, .dst = p->v4.daddr, .id = p->frag_id,
		.proto = p->proto, .dir = dir,
	};
	struct frag_v4_val v = { .addr = to };

	bpf_map_update_elem(&frag_v4, &k, &v, BPF_ANY);
}

static __always_inline void frag_remember_v6(const struct pkt *p, int dir, const __u8 *to)
{
	struct frag_v6_key k = { .id = p->frag_id, .proto = p->proto, .dir = dir };
	struct frag_v6_val v;

	__builtin_memcpy(k.src, p->v6.saddr, 16);
	__builtin_memcpy(k.dst, p->v6.daddr, 16);
	__builtin_memcpy(v.addr, to, 16);
	bpf_map_update_elem(&frag_v6, &k, &v, BPF_ANY);
}

static __always_inline struct frag_v4_val *frag_lookup_v4(const struct pkt *p, int dir)
{
	struct frag_v4_key k = {
		.src = p->v4.saddr, .dst = p->v4.daddr, .id = p->frag_id,
		.proto = p->proto, .dir = dir,
	};

	return bpf_map_lookup_elem(&frag_v4, &k);
}

static __always_inline struct frag_v6_val *frag_lookup_v6(const struct pkt *p, int dir)
{
	struct frag_v6_key k = { .id = p->frag_id, .proto = p->proto, .dir = dir };

	__builtin_memcpy(k.src, p->v6.saddr, 16);
	__builtin_memcpy(k.dst, p->v6.daddr, 16);
	return bpf_map_lookup_elem(&frag_v6, &k);
}

/* ---- ICMP errors -------------------------------------------------------- */

/*
 * An ICMP error about a translated flow quotes the packet as we sent it
 * (src = SNAT address, sport = NAT port). The reply entry of that flow has
 * the quoted tuple reversed. Rewritten: the outer destination, the quoted
 * source address and port, the quoted IPv4 header checksum, the quoted L4
 * checksum when the quote includes it, and the ICMP checksum for every
 * changed payload field. The quoted address and quoted IPv4 checksum change
 * by opposite amounts, so they leave the ICMP checksum alone; the quoted L4
 * checksum does not (it also covers the unquoted rest of the segment), so
 * its change is applied to the ICMP checksum explicitly. Quoted checksums
 * are patched with bpf_l3_csum_replace, which edits a checksum field
 * regardless of skb->ip_summed.
 */

/* Inner L4 lookup shared by both families: the quoted ports (or echo id) as
 * the dir-1 key wants them. Returns -1 if the quote cannot be translated. */
static __always_inline int icmp_inner_ports(struct __sk_buff *skb, __u8 proto, __u32 off,
					    __be16 *sport, __be16 *dport, __u32 *port_off)
{
	struct {
		__be16 a;
		__be16 b;
		__be16 c;
	} h;

	if (bpf_skb_load_bytes(skb, off, &h, sizeof(h)) < 0 &&
	    (proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP ||
	     proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6))
		return -1;
	switch (proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		/* quoted sport is our NAT port: reversed it is the reply's dport */
		*sport = h.b;
		*dport = h.a;
		*port_off = off;
		return 0;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		/* only quoted echo requests have an identifier we allocated */
		if ((__u8)h.a != (proto == IPPROTO_ICMP ? ICMP_ECHO : ICMPV6_ECHO_REQUEST))
			return -1;
		*sport = 0;
		*dport = h.c;
		*port_off = off + 4;
		return 0;
	}
	/* address-only: no ports (the quote may be shorter than h: GRE, ESP
	 * quotes hold 8 bytes at least, as RFC 792 promises) */
	*sport = 0;
	*dport = 0;
	*port_off = 0;
	return 0;
}

/* icmp_inner_l4_csum returns the offset of the quoted L4 checksum, or 0 when
 * the quote is too short to hold it or it is a zero (absent) UDP checksum. */
static __always_inline __u32 icmp_inner_l4_csum(struct __sk_buff *skb, __u8 proto, __u32 off)
{
	__u32 csum_off = off + l4_csum_off(proto);
	__be16 csum;

	/* SCTP's CRC32c and GRE's checksum do not cover addresses or change */
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_ICMP &&
	    proto != IPPROTO_ICMPV6)
		return 0;
	if (csum_off + 2 > skb->len)
		return 0;
	if (bpf_skb_load_bytes(skb, csum_off, &csum, 2) < 0)
		return 0;
	if (proto == IPPROTO_UDP && csum == 0)
		return 0;
	return csum_off;
}

/* icmp_quote_port rewrites the quoted port (or echo id) and the quoted L4
 * checksum, and carries both changes into the outer ICMP checksum. addr_diff
 * is the change of the quoted address for the quoted pseudo header (0 for
 * ICMP quotes, which have none). port_off 0: an address-only quote, no
 * port. */
static __always_inline int icmp_quote_port(struct __sk_buff *skb, __u32 icmp_csum, __u8 proto,
					   __u32 l4_off, __u32 port_off, __be16 pfrom, __be16 pto,
					   __u32 addr_diff)
{
	__u32 csum_off = icmp_inner_l4_csum(skb, proto, l4_off);
	__be16 old_csum, new_csum;

	if (csum_off) {
		if (bpf_skb_load_bytes(skb, csum_off, &old_csum, 2) < 0)
			return -1;
		if (addr_diff &&
		    bpf_l3_csum_replace(skb, csum_off, 0, addr_diff, 0) < 0)
			return -1;
		if (port_off && bpf_l3_csum_replace(skb, csum_off, pfrom, pto, 2) < 0)
			return -1;
		if (bpf_skb_load_bytes(skb, csum_off, &new_csum, 2) < 0)
			return -1;
		if (proto == IPPROTO_UDP && new_csum == 0) {
			/* zero means "no checksum" for UDP */
			new_csum = 0xffff;
			if (bpf_skb_store_bytes(skb, csum_off, &new_csum, 2, 0) < 0)
				return -1;
		}
		if (bpf_l4_csum_replace(skb, icmp_csum, old_csum, new_csum, 2) < 0)
			return -1;
	}
	if (!port_off || pfrom == pto)
		return 0;
	if (bpf_l4_csum_replace(skb, icmp_csum, pfrom, pto, 2) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, port_off, &pto, 2, 0) < 0)
		return -1;
	return 0;
}

static __noinline int icmp_error_v4(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 inner_off = p->l4_off + 8, inner_l4, port_off, addr_diff = 0;
	__u32 icmp_csum = p->l4_off + 2;
	struct nat_v4_key k = { .dir = DIR_INGRESS };
	struct nat_v4_val *v;
	struct iphdr ip;
	__be32 from, to;
	__be16 pfrom;

	if (bpf_skb_load_bytes(skb, inner_off, &ip, sizeof(ip)) < 0)
		return TC_ACT_UNSPEC;
	if (ip.version != 4 || ip.ihl < 5 || ip.saddr != p->v4.daddr ||
	    (bpf_ntohs(ip.frag_off) & IP_OFFSET))
		return TC_ACT_UNSPEC;
	inner_l4 = inner_off + ip.ihl * 4;
	k.src = ip.daddr;
	k.dst = ip.saddr;
	k.proto = ip.protocol;
	if (icmp_inner_ports(skb, ip.protocol, inner_l4, &k.sport, &k.dport, &port_off) < 0)
		return TC_ACT_UNSPEC;
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (!v)
		return TC_ACT_UNSPEC;
	from = ip.saddr;
	to = v->addr;
	pfrom = k.dport;

	/* outer destination: the IPv4 header checksum only */
	if (bpf_l3_csum_replace(skb, p->l3_off + offsetof(struct iphdr, check), from, to, 4) < 0 ||
	    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct iphdr, daddr), &to, 4, 0) < 0)
		goto err;
	/* quoted source and quoted header checksum: net zero for the ICMP sum */
	if (bpf_l3_csum_replace(skb, inner_off + offsetof(struct iphdr, check), from, to, 4) < 0 ||
	    bpf_skb_store_bytes(skb, inner_off + offsetof(struct iphdr, saddr), &to, 4, 0) < 0)
		goto err;
	if (ip.protocol != IPPROTO_ICMP)
		addr_diff = bpf_csum_diff(&from, 4, &to, 4, 0);
	if (icmp_quote_port(skb, icmp_csum, ip.protocol, inner_l4, port_off, pfrom, v->port,
			    addr_diff) < 0)
		goto err;
	count(COUNTER_ICMP_ERR_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

static __noinline int icmp_error_v6(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 inner_off = p->l4_off + 8, inner_l4 = inner_off + sizeof(struct ipv6hdr), port_off;
	__u32 icmp_csum = p->l4_off + 2, diff;
	struct nat_v6_key k = { .dir = DIR_INGRESS };
	struct nat_v6_val *v;
	struct ipv6hdr ip;
	__u8 from[16], to[16];
	__be16 pfrom;

	if (bpf_skb_load_bytes(skb, inner_off, &ip, sizeof(ip)) < 0)
		return TC_ACT_UNSPEC;
	if (ip.version != 6 || !addr6_equal((const __u8 *)&ip.saddr, p->v6.daddr))
		return TC_ACT_UNSPEC;
	/* Quotes with extension headers are not translated. */
	__builtin_memcpy(k.src, &ip.daddr, 16);
	__builtin_memcpy(k.dst, &ip.saddr, 16);
	k.proto = ip.nexthdr;
	if (icmp_inner_ports(skb, ip.nexthdr, inner_l4, &k.sport, &k.dport, &port_off) < 0)
		return TC_ACT_UNSPEC;
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (!v)
		return TC_ACT_UNSPEC;
	__builtin_memcpy(from, &ip.saddr, 16);
	__builtin_memcpy(to, v->addr, 16);
	pfrom = k.dport;
	diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);

	/* outer destination: in the ICMPv6 pseudo header */
	if (bpf_l4_csum_replace(skb, icmp_csum, 0, diff, BPF_F_PSEUDO_HDR | csum_ipv6_flag) < 0 ||
	    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct ipv6hdr, daddr), to, 16, 0) < 0)
		goto err;
	/* quoted source: ICMPv6 payload */
	if (bpf_l4_csum_replace(skb, icmp_csum, 0, diff, 0) < 0 ||
	    bpf_skb_store_bytes(skb, inner_off + offsetof(struct ipv6hdr, saddr), to, 16, 0) < 0)
		goto err;
	/* ICMPv6 quotes have a pseudo header too */
	if (icmp_quote_port(skb, icmp_csum, ip.nexthdr, inner_l4, port_off, pfrom, v->port,
			    diff) < 0)
		goto err;
	count(COUNTER_ICMP_ERR_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

#include "icmp_egress.h"
#include "proto.h"

/* ---- Egress ------------------------------------------------------------- */

/* A non-first fragment: L3 rewrite from the first fragment's record. */
static __always_inline int egress_frag_v4(struct __sk_buff *skb, const struct pkt *p,
					  const struct masq_rule *rule)
{
	struct frag_v4_val *f = frag_lookup_v4(p, DIR_EGRESS);
	enum counter c;
	__be32 snat;

	if (!f) {
		c = decide_v4(skb, p->v4.saddr, p->v4.daddr, rule, &snat);
		if (c != COUNTER_MASQUERADED) {
			count(c);
			return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
		}
		count(COUNTER_FRAG_UNKNOWN);
		return TC_ACT_SHOT;
	}
	if (rewrite_v4(skb, p->l3_off, p->l3_off + offsetof(struct iphdr, saddr), p->v4.saddr, f->addr,
		       p->proto, 0, 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_FRAGMENTS);
	return TC_ACT_UNSPEC;
}

static __always_inline int egress_frag_v6(struct __sk_buff *skb, const struct pkt *p,
					  const struct masq_rule *rule)
{
	struct frag_v6_val *f = frag_lookup_v6(p, DIR_EGRESS);
	__u8 from[16], to[16];
	enum counter c;

	if (!f) {
		c = decide_v6(skb, p, rule, to);
		if (c != COUNTER_MASQUERADED) {
			count(c);
			return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
		}
		count(COUNTER_FRAG_UNKNOWN);
		return TC_ACT_SHOT;
	}
	__builtin_memcpy(from, p->v6.saddr, 16);
	__builtin_memcpy(to, f->addr, 16);
	if (rewrite_v6(skb, p->l3_off + offsetof(struct ipv6hdr, saddr), from, to,
		       p->proto, 0, 0, 0, 0) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_FRAGMENTS);
	return TC_ACT_UNSPEC;
}

static __always_inline int egress_v4(struct __sk_buff *skb, __u32 l3_off)
{
	struct nat_v4_key k = { .dir = DIR_EGRESS };
	const struct masq_rule *rule;
	struct nat_v4_val *v, nv;
	struct pkt p;
	enum counter c;
	__be32 snat;
	int verdict, node;

	p.l3_off = l3_off;
	if (parse_l3_v4(skb, &p) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_UNSPEC;
	}
	/* Before the source check: the node's own errors count too. */
	if (p.proto == IPPROTO_ICMP && p.frag == FRAG_NONE) {
		verdict = egress_icmp_error_v4(skb, &p);
		if (verdict != NOT_TRANSLATED_ERROR)
			return verdict;
	}
	node = !masq_source_v4(skb, p.v4.saddr, &rule);
	if (node) {
		/* The node's own flow: translated only when a pod's flow held its
		 * tuple (host_flow_v4). */
		if (host_flow_v4(skb, &p) != HOST_PAIR) {
			count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		rule = NULL;
	} else {
		if (p.frag == FRAG_LATER)
			return egress_frag_v4(skb, &p, rule);
		if (parse_l4(skb, &p, DIR_EGRESS) < 0) {
			/* truncated L4 header from a masquerade source: cannot translate */
			count(COUNTER_ERROR);
			return TC_ACT_SHOT;
		}
		if (p.kind == PKT_ECHO_INBOUND) {
			if (inbound_reply_v4(&p)) {
				count(COUNTER_SKIP_INBOUND_REPLY);
				return TC_ACT_UNSPEC;
			}
			/* an echo reply of no flow we know of */
			return egress_untranslatable_v4(skb, &p, rule);
		}
		if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
			return egress_fixed_v4(skb, &p, rule);
		if (p.kind == PKT_ICMP_ERR)
			return icmp_error_unmatched_v4(skb, &p, rule);
		if (p.kind != PKT_PORTS)
			return egress_untranslatable_v4(skb, &p, rule);
	}

	k.src = p.v4.saddr;
	k.dst = p.v4.daddr;
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	/* Established flows: the decision was taken when the pair was made
	 * (masq_source_v4 says what happens when a source stops being one). */
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (v && nat_established_v4(&k, v, &p))
		v = NULL;
	if (v) {
		nv.addr = v->addr;
		nv.port = v->port;
	} else {
		if (egress_no_pair(&p, 0))
			return TC_ACT_UNSPEC;
		if (node) {
			snat = p.v4.saddr; /* a new port, the same address */
		} else {
			c = decide_v4(skb, p.v4.saddr, p.v4.daddr, rule, &snat);
			if (c != COUNTER_MASQUERADED) {
				count(c);
				return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
			}
		}
		c = nat_create_v4(skb, &k, snat, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | (node ? NAT_CREATE_NODE : 0), &nv);
		if (c != COUNTER_NAT_NEW && c != COUNTER_MASQUERADED) {
			count(c);
			return TC_ACT_SHOT;
		}
		if (c == COUNTER_NAT_NEW) {
			count(node ? COUNTER_HOST_FLOW_REMAPPED : COUNTER_NAT_NEW);
			if (rule)
				count(COUNTER_NAT_NEW_BY_RULE);
		}
	}
	if (p.frag == FRAG_FIRST)
		frag_remember_v4(&p, DIR_EGRESS, nv.addr);
	if (rewrite_v4(skb, p.l3_off, p.l3_off + offsetof(struct iphdr, saddr), p.v4.saddr, nv.addr,
		       p.proto, p.l4_off + l4_csum_off(p.proto),
		       p.l4_off + l4_port_off(p.proto, DIR_EGRESS), p.sport, nv.port) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_MASQUERADED);
	return TC_ACT_UNSPEC;
}

static __always_inline int egress_v6(struct __sk_buff *skb, __u32 l3_off)
{
	struct nat_v6_key k = { .dir = DIR_EGRESS };
	struct nat_v6_val *v, nv;
	const struct masq_rule *rule;
	struct pkt p;
	enum counter c;
	int ret, verdict, node;

	p.l3_off = l3_off;
	ret = parse_l3_v6(skb, &p);
	if (ret < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_UNSPEC;
	}
	if (ret == 0 && p.proto == IPPROTO_ICMPV6 && p.frag == FRAG_NONE) {
		verdict = egress_icmp_error_v6(skb, &p);
		if (verdict != NOT_TRANSLATED_ERROR)
			return verdict;
	}
	node = !masq_source_v6(skb, p.v6.saddr, &rule);
	if (node) {
		/* See egress_v4. */
		if (ret != 0 || host_flow_v6(skb, &p) != HOST_PAIR) {
			count(COUNTER_SKIP_NOT_SOURCE);
			return TC_ACT_UNSPEC;
		}
		rule = NULL;
	} else {
		if (ret > 0)
			return egress_untranslatable_v6(skb, &p, rule);
		if (p.frag == FRAG_LATER)
			return egress_frag_v6(skb, &p, rule);
		if (parse_l4(skb, &p, DIR_EGRESS) < 0) {
			count(COUNTER_ERROR);
			return TC_ACT_SHOT;
		}
		if (p.kind == PKT_ECHO_INBOUND) {
			if (inbound_reply_v6(&p)) {
				count(COUNTER_SKIP_INBOUND_REPLY);
				return TC_ACT_UNSPEC;
			}
			/* an echo reply of no flow we know of */
			return egress_untranslatable_v6(skb, &p, rule);
		}
		if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
			return egress_fixed_v6(skb, &p, rule);
		if (p.kind == PKT_ICMP_ERR)
			return icmp_error_unmatched_v6(skb, &p, rule);
		if (p.kind != PKT_PORTS)
			return egress_untranslatable_v6(skb, &p, rule);
	}

	__builtin_memcpy(k.src, p.v6.saddr, 16);
	__builtin_memcpy(k.dst, p.v6.daddr, 16);
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (v && nat_established_v6(&k, v, &p))
		v = NULL;
	if (v) {
		__builtin_memcpy(nv.addr, v->addr, 16);
		nv.port = v->port;
	} else {
		if (egress_no_pair(&p, 1))
			return TC_ACT_UNSPEC;
		if (node) {
			__builtin_memcpy(nv.addr, p.v6.saddr, 16);
		} else {
			c = decide_v6(skb, &p, rule, nv.addr);
			if (c != COUNTER_MASQUERADED) {
				count(c);
				return c == COUNTER_DROP_NO_SNAT_ADDR ? TC_ACT_SHOT : TC_ACT_UNSPEC;
			}
		}
		c = nat_create_v6(skb, &k, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | (node ? NAT_CREATE_NODE : 0), &nv);
		if (c != COUNTER_NAT_NEW && c != COUNTER_MASQUERADED) {
			count(c);
			return TC_ACT_SHOT;
		}
		if (c == COUNTER_NAT_NEW) {
			count(node ? COUNTER_HOST_FLOW_REMAPPED : COUNTER_NAT_NEW);
			if (rule)
				count(COUNTER_NAT_NEW_BY_RULE);
		}
	}
	if (p.frag == FRAG_FIRST)
		frag_remember_v6(&p, DIR_EGRESS, nv.addr);
	/* k.src is the packet's source (rewrite_v6 needs a copy off the packet). */
	if (rewrite_v6(skb, p.l3_off + offsetof(struct ipv6hdr, saddr), k.src, nv.addr,
		       p.proto, p.l4_off + l4_csum_off(p.proto),
		       p.l4_off + l4_port_off(p.proto, DIR_EGRESS), p.sport, nv.port) < 0) {
		count(COUNTER_ERROR);
		return TC_ACT_SHOT;
	}
	count(COUNTER_MASQUERADED);
	return TC_ACT_UNSPEC;
}

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

/* Ethernet devices: the network header follows the Ethernet header. */
SEC("tc")
int ipmasq_egress(struct __sk_buff *skb)
{
	return egress(skb, ETH_HLEN);
}

/* Devices without a link-layer header (tun, WireGuard, ipip, sit, ip6tnl,
 * point-to-point GRE): tc sees the packet from its network header. The
 * offset is a constant per program, so the verifier and the compiler see
 * the same code as the Ethernet variant's. */
SEC("tc")
int ipmasq_egress_l3(struct __sk_buff *skb)
{
	return egress(skb, 0);
}

/* ---- Ingress ------------------------------------------------------------ */

/* Misses are not counted on ingress: most packets are the host's own. */

static __always_inline int ingress_v4(struct __sk_buff *skb, __u32 l3_off)
{
	struct nat_v4_key k = { .dir = DIR_INGRESS };
	struct frag_v4_val *f;
	struct nat_v4_val *v;
	__be32 to;
	struct pkt p;

	p.l3_off = l3_off;
	if (parse_l3_v4(skb, &p) < 0)
		return TC_ACT_UNSPEC;
	if (p.frag == FRAG_LATER) {
		f = frag_lookup_v4(&p, DIR_INGRESS);
		if (!f)
			return TC_ACT_UNSPEC;
		if (rewrite_v4(skb, p.l3_off, p.l3_off + offsetof(struct iphdr, daddr), p.v4.daddr, f->addr,
			       p.proto, 0, 0, 0, 0) < 0)
			goto err;
		count(COUNTER_FRAGMENTS);
		return TC_ACT_UNSPEC;
	}
	if (parse_l4(skb, &p, DIR_INGRESS) < 0)
		return TC_ACT_UNSPEC;
	if (p.kind == PKT_ICMP_ERR)
		return icmp_error_v4(skb, &p);
	if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
		return ingress_fixed_v4(skb, &p);
	if (p.kind == PKT_ECHO_INBOUND) {
		inbound_track_v4(skb, &p);
		return TC_ACT_UNSPEC;
	}
	if (p.kind != PKT_PORTS)
		return TC_ACT_UNSPEC;

	k.src = p.v4.saddr;
	k.dst = p.v4.daddr;
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	v = bpf_map_lookup_elem(&nat_v4, &k);
	if (!v) {
		inbound_track_v4(skb, &p);
		return TC_ACT_UNSPEC;
	}
	nat_touch_v4(v, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	if (v->flags & NAT_F_HOST)
		return TC_ACT_UNSPEC; /* a node flow's reply */
	to = v->addr;
	if (p.frag == FRAG_FIRST)
		frag_remember_v4(&p, DIR_INGRESS, to);
	if (rewrite_v4(skb, p.l3_off, p.l3_off + offsetof(struct iphdr, daddr), p.v4.daddr, to,
		       p.proto, p.l4_off + l4_csum_off(p.proto),
		       p.l4_off + l4_port_off(p.proto, DIR_INGRESS), p.dport, v->port) < 0)
		goto err;
	count(COUNTER_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

static __always_inline int ingress_v6(struct __sk_buff *skb, __u32 l3_off)
{
	struct nat_v6_key k = { .dir = DIR_INGRESS };
	struct frag_v6_val *f;
	struct nat_v6_val *v;
	__u8 from[16], to[16];
	struct pkt p;

	p.l3_off = l3_off;
	if (parse_l3_v6(skb, &p) != 0)
		return TC_ACT_UNSPEC;
	__builtin_memcpy(from, p.v6.daddr, 16);
	if (p.frag == FRAG_LATER) {
		f = frag_lookup_v6(&p, DIR_INGRESS);
		if (!f)
			return TC_ACT_UNSPEC;
		__builtin_memcpy(to, f->addr, 16);
		if (rewrite_v6(skb, p.l3_off + offsetof(struct ipv6hdr, daddr), from, to,
			       p.proto, 0, 0, 0, 0) < 0)
			goto err;
		count(COUNTER_FRAGMENTS);
		return TC_ACT_UNSPEC;
	}
	if (parse_l4(skb, &p, DIR_INGRESS) < 0)
		return TC_ACT_UNSPEC;
	if (p.kind == PKT_ICMP_ERR)
		return icmp_error_v6(skb, &p);
	if (p.kind == PKT_SCTP || p.kind == PKT_ADDR)
		return ingress_fixed_v6(skb, &p);
	if (p.kind == PKT_ECHO_INBOUND) {
		inbound_track_v6(skb, &p);
		return TC_ACT_UNSPEC;
	}
	if (p.kind != PKT_PORTS)
		return TC_ACT_UNSPEC;

	__builtin_memcpy(k.src, p.v6.saddr, 16);
	__builtin_memcpy(k.dst, p.v6.daddr, 16);
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	v = bpf_map_lookup_elem(&nat_v6, &k);
	if (!v) {
		inbound_track_v6(skb, &p);
		return TC_ACT_UNSPEC;
	}
	nat_touch_v6(v, (p.tcp_flags & (NAT_F_FIN | NAT_F_RST)) | NAT_F_SEEN);
	if (v->flags & NAT_F_HOST)
		return TC_ACT_UNSPEC; /* a node flow's reply */
	__builtin_memcpy(to, v->addr, 16);
	if (p.frag == FRAG_FIRST)
		frag_remember_v6(&p, DIR_INGRESS, to);
	if (rewrite_v6(skb, p.l3_off + offsetof(struct ipv6hdr, daddr), from, to,
		       p.proto, p.l4_off + l4_csum_off(p.proto),
		       p.l4_off + l4_port_off(p.proto, DIR_INGRESS), p.dport, v->port) < 0)
		goto err;
	count(COUNTER_REVERSE);
	return TC_ACT_UNSPEC;
err:
	count(COUNTER_ERROR);
	return TC_ACT_SHOT;
}

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

SEC("tc")
int ipmasq_ingress(struct __sk_buff *skb)
{
	return ingress(skb, ETH_HLEN);
}

SEC("tc")
int ipmasq_ingress_l3(struct __sk_buff *skb)
{
	return ingress(skb, 0);
}
