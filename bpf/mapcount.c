//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The kernel's count of each map's elements: a bpf_map iterator that writes
 * {map id, elements} for every map of the system. Hash maps of every kind
 * (preallocated, BPF_F_NO_PREALLOC, LRU) keep the count on every insert,
 * delete and LRU eviction (map->elem_count, per CPU);
 * bpf_map_sum_elem_count sums it. Reading it costs the same whatever a
 * map holds: a walk of an LRU reads every bucket of its capacity.
 */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* The kernel's types, only the fields read (CO-RE: relocated against the
 * running kernel's BTF). */
struct bpf_map {
	__u32 id;
} __attribute__((preserve_access_index));

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct bpf_iter__bpf_map {
	struct bpf_iter_meta *meta;
	struct bpf_map *map;
} __attribute__((preserve_access_index));

extern __s64 bpf_map_sum_elem_count(const struct bpf_map *map) __ksym;

char LICENSE[] SEC("license") = "Dual BSD/GPL";

SEC("iter/bpf_map")
int map_elem_counts(struct bpf_iter__bpf_map *ctx)
{
	struct bpf_map *map = ctx->map;
	__s64 rec[2];

	if (!map)
		return 0;
	rec[0] = map->id;
	rec[1] = bpf_map_sum_elem_count(map);
	bpf_seq_write(ctx->meta->seq, rec, sizeof(rec));
	return 0;
}
