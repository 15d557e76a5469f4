/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The maps: written by the agent (sources, rules, addresses, devices,
 * config), shared state (NAT pairs, fragments) and per-CPU scratch space. */

#ifndef IPMASQ_LIB_MAPS_H
#define IPMASQ_LIB_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"

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

/* Plain hash maps: nothing is evicted behind the programs' back. A full
 * table admits a new flow by dropping a pair that is not assured, both
 * halves, or refuses it (lib/pressure.h, conntrack's early drop), with or
 * without the agent. Not preallocated: memory follows the flows, as
 * conntrack's does. At the agent's default 524 288 entries the IPv4 map
 * takes 8 MiB empty (its buckets), 17.2 MiB with 50 000 flows and 56 MiB
 * full, where a preallocated one takes 52 MiB from the start (IPv6: 8 /
 * 21.0 / 76 against 72); a new flow's two inserts cost about a tenth more
 * (an allocation from the BPF allocator's per-CPU caches instead of a free
 * list), a packet of an established flow the same (docs/datapath.md "Map
 * kinds"). An LRU would evict one half of a pair behind the programs'
 * back. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct nat_v4_key);
	__type(value, struct nat_v4_val);
	__uint(max_entries, 131072);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} nat_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct nat_v6_key);
	__type(value, struct nat_v6_val);
	__uint(max_entries, 131072);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} nat_v6 SEC(".maps");

/* Flows that started unmasqueraded (lib/unmasq.h). LRU: a record lost to
 * eviction only means its flow is decided again by its next packet, which
 * matters only if the config changed meanwhile. The loader sizes them to a
 * quarter of the NAT maps' entries. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct nat_v4_key);
	__type(value, struct unmasq_val);
	__uint(max_entries, 32768);
} unmasq_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct nat_v6_key);
	__type(value, struct unmasq_val);
	__uint(max_entries, 32768);
} unmasq_v6 SEC(".maps");

/* Where the source's first FIN of a TCP pair ends in the sequence space,
 * keyed by the pair's reply (dir 1) key, until the remote's FIN says
 * whether it acknowledges it (who closed first, lib/flow.h). LRU: a record
 * lost only costs that pair's early reuse by another source. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct nat_v4_key);
	__type(value, __u32);
	__uint(max_entries, 16384);
} nat_fin_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct nat_v6_key);
	__type(value, __u32);
	__uint(max_entries, 16384);
} nat_fin_v6 SEC(".maps");

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

/* A NAT key and value for the map helpers, copied from a global function's
 * pointer arguments: those are no map key or value before 6.2
 * (lib/compat.h: "Keys"), and copies on the stack would take the IPv6
 * egress path's stack over 512 bytes (nat_established). Per CPU: a tc
 * program runs to its end on its CPU. */
struct nat_v4_scratch {
	struct nat_v4_key key;
	struct nat_v4_val val;
};

struct nat_v6_scratch {
	struct nat_v6_key key;
	struct nat_v6_val val;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct nat_v4_scratch);
	__uint(max_entries, 1);
} nat_scratch_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct nat_v6_scratch);
	__uint(max_entries, 1);
} nat_scratch_v6 SEC(".maps");

static __always_inline struct masq_config *masq_cfg(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&config, &zero);
}

#endif /* IPMASQ_LIB_MAPS_H */
