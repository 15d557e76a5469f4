/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The key and value types of the maps, their flags and the NAT directions. */

#ifndef IPMASQ_LIB_TYPES_H
#define IPMASQ_LIB_TYPES_H

#include <linux/bpf.h>
#include <linux/types.h>
#include <bpf/bpf_helpers.h>

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

/* The value of masq_src_v4/v6 (LPM, longest source prefix wins): what a
 * packet from the prefix is, whatever device it leaves through. The agent
 * computes each entry's flags from every prefix that covers it, so the
 * longest match alone decides. MASQ_SRC_MASQUERADE: a masquerade source
 * (by default every forwarded source; the node's own addresses are entries
 * without it). MASQ_SRC_RULES: some masquerade rule names the prefix, so
 * masq_rules_* is looked up first (its toAddress and devices apply); a
 * source without it costs one lookup. */
enum masq_src_flag {
	MASQ_SRC_MASQUERADE = 1,
	MASQ_SRC_RULES = 2,
};

const volatile enum masq_src_flag masq_src_flags_known = MASQ_SRC_RULES;

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
	NAT_UDP,		/* UDP: a query, answered or not (30 s) */
	NAT_UDP_STREAM,		/* UDP stream: answered, and active 2 s after it started */
	NAT_ICMP,		/* ICMP echo */
	NAT_OTHER,		/* SCTP and address-only pairs (GRE, ESP, ...) */
	NAT_STATE_MAX,
};

/* Exported so that bpf2go emits the enum for Go (bpf.NATState). */
const volatile enum nat_state nat_state_max = NAT_STATE_MAX;

/* Several NAT port ranges (--nat-port-range a-b,c-d, the Kubernetes agent's
 * --to-ports=1024-29999,32768-65535; any number, overlapping or not) are
 * their sorted union, every port of it once, in order, in nat_ports
 * (NAT_PORTS_BLOCK a value), and as bits in nat_port_set (bit p % 64 of
 * entry p / 64): the search draws an index, membership is one lookup. */
enum { NAT_PORTS_BLOCK = 32 };

struct nat_port_block {
	__u16 port[NAT_PORTS_BLOCK];
};

/* Host byte order. timeout_ns: idle lifetime per enum nat_state, written by
 * the agent (a zero lifetime never expires a pair here). The NAT ports are
 * port_min-port_max while port_ranges is 0 or 1; with several ranges,
 * port_total ports in nat_ports, port_min and port_max the lowest and
 * highest of them. */
struct masq_config {
	__u16 port_min;
	__u16 port_max;
	__u32 flags;	/* MASQ_CFG_* */
	__u64 timeout_ns[NAT_STATE_MAX];
	__u32 port_ranges;
	__u32 port_total;
};

/* masq_config.flags */
enum masq_cfg_flag {
	MASQ_CFG_KEEP_PORT = 0x1,	/* a TCP/UDP flow keeps its own source port (>= 1024) when free */
	MASQ_CFG_RANDOM_FULLY = 0x2,	/* MASQUERADE --random-fully: a TCP/UDP flow's own port is not tried first */
};

/* Exported so that bpf2go emits the enum for Go (bpf.ConfigKeepPort). */
const volatile enum masq_cfg_flag masq_cfg_flags_known = MASQ_CFG_KEEP_PORT | MASQ_CFG_RANDOM_FULLY;

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
enum nat_flag {
	NAT_F_FIN = 0x01,		/* this direction sent a FIN */
	NAT_F_RST = 0x02,		/* this direction sent a RST */
	NAT_F_SEEN = 0x04,		/* dir 1 and 2: the answering side has sent a packet */
	NAT_F_HOST = 0x08,		/* dir 1: a node flow's tuple, held so no NAT pair takes it */
	NAT_F_CLOSED_FIRST = 0x10,	/* dir 0: the remote's FIN acknowledged the source's first FIN (it holds no TIME_WAIT) */
	NAT_F_STREAM = 0x20,		/* dir 1, UDP: answered and still active 2 s after it started (conntrack's stream_ts) */
	NAT_F_STORED = NAT_F_FIN | NAT_F_RST | NAT_F_SEEN | NAT_F_HOST | NAT_F_CLOSED_FIRST | NAT_F_STREAM,
};

/* Exported so that bpf2go emits the enum for Go (bpf.NATFlag*). */
const volatile enum nat_flag nat_flags_stored = NAT_F_STORED;

/* nat_*_val.handover of a reply (dir 1) entry: who holds the pair's
 * translation (lib/handover.h). Its own byte, written by the agent only,
 * so that no program's write of flags can lose it. */
enum nat_handover {
	NAT_HANDOVER_NONE,	/* the programs translate the pair */
	NAT_HANDOVER_CONNTRACK,	/* conntrack may hold it: the programs translate
				 * only what conntrack does not */
};

/* Exported so that bpf2go emits the enum for Go. */
const volatile enum nat_handover nat_handover_last = NAT_HANDOVER_CONNTRACK;

/* pkt.tcp_flags only, never stored. */
#define PKT_F_SYN	0x40
#define PKT_F_ACK	0x80

/* tcp_end (TCP pairs, host byte order, 0: not seen yet) is the sequence
 * number after the highest segment this direction sent (SYN and FIN count
 * one); it checks a RST against the connection as conntrack does
 * (lib/flow.h, "RSTs"). It comes last: a pinned map of the older, shorter
 * layout is copied into this one with it zero (bpfmap.OpenPinnedKeep). */
struct nat_v4_val {
	__be32 addr;
	__be16 port;
	__u8 flags;
	__u8 handover;	/* enum nat_handover: who may hold the translation */
	__u64 last_seen_ns;
	__u64 created_ns;
	__u32 tcp_end;
	__u32 pad2;
};

struct nat_v6_val {
	__u8 addr[16];
	__be16 port;
	__u8 flags;
	__u8 handover;	/* enum nat_handover */
	__u8 pad[4];
	__u64 last_seen_ns;
	__u64 created_ns;
	__u32 tcp_end;
	__u32 pad2;
};

/* A flow from a masquerade source that started unmasqueraded (its
 * destination was a non-masquerade one), keyed by its egress tuple like a
 * NAT pair's dir-0 entry (lib/unmasq.h). flags: NAT_F_FIN, NAT_F_RST and
 * NAT_F_SEEN (TCP: the source sent more than a SYN) as the source side
 * showed them, for the lifetime of its state (nat_state). */
struct unmasq_val {
	__u64 last_seen_ns;
	__u8 flags;
	__u8 pad[7];
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

/* nat_*_key.dir and frag_*_key.dir. */
enum nat_dir {
	DIR_EGRESS = 0,
	DIR_INGRESS = 1,
	/* An inbound flow: a remote opened it toward a masquerade source. Keyed
	 * like dir 0 (the source's reply tuple); its replies leave untranslated. */
	DIR_INBOUND = 2,
};

/* Exported so that bpf2go emits the enum for Go (bpf.Dir*). */
const volatile enum nat_dir nat_dir_last = DIR_INBOUND;

/* Addresses as the maps hold them, in network byte order: a family
 * template's FAM_ADDR (family.h). */
typedef __be32 addr4_t;
typedef __u8 addr6_t[16];

static __always_inline int addr6_equal(const __u8 *a, const __u8 *b)
{
	__u64 a0, a1, b0, b1;

	__builtin_memcpy(&a0, a, 8);
	__builtin_memcpy(&a1, a + 8, 8);
	__builtin_memcpy(&b0, b, 8);
	__builtin_memcpy(&b1, b + 8, 8);
	return a0 == b0 && a1 == b1;
}

#endif /* IPMASQ_LIB_TYPES_H */
