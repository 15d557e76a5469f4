/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The two builds of the datapath, and every difference between them.
 *
 * masq.c is compiled twice from the same sources (bpf/gen.go):
 *
 *   masq         the full object, for kernels from 5.14: the
 *                agent's programs are BPF_PROG_TYPE_SYSCALL (5.14), the
 *                claims are the CPU's compare-and-swap (BPF_ATOMIC with
 *                BPF_CMPXCHG, 5.12), the records' clock is
 *                bpf_ktime_get_coarse_ns (5.11).
 *   masq_compat  the same programs for kernels from 5.10 on, built with
 *                -DIPMASQ_COMPAT: what those kernels lack is replaced here
 *                by what they have, with the same decisions and the same
 *                atomicity (below); the records' clock is the coarse one
 *                where the kernel has it (compat_coarse_clock). The agent
 *                picks the object when it starts (bpf/variant.go).
 *
 * Atomics. A claim (lib/flow.h) must be won by one party only: in the
 * compat build a compare-and-swap or a fetch-and-add whose result is used
 * takes one bpf_spin_lock (atomic_lock below) around a load and a store,
 * and so does every store that races with them (atomic_store64): the
 * verifier allows no call while the lock is held, but loads and stores
 * through map value pointers looked up before are allowed, which is all a
 * swap needs. Adds whose result is not used are BPF_XADD in both builds
 * (every kernel). The lock serialises only these few instructions.
 *
 * Keys. Before 6.2 the verifier takes no global function's pointer
 * argument (PTR_TO_MEM) as a map key or value: the global functions
 * (__noinline, not static: verified once, whatever the caller) copy theirs
 * to the stack before a map helper sees them, in both builds.
 *
 * The agent's programs (masq.c's AGENT_RUN): SEC("syscall") programs read
 * and write their context; in the compat build they are SEC("tc")
 * programs the agent runs the same way (BPF_PROG_TEST_RUN), the context
 * passed as the packet's bytes (read with bpf_skb_load_bytes) and the
 * result returned as the program's return value.
 */

#ifndef IPMASQ_LIB_COMPAT_H
#define IPMASQ_LIB_COMPAT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#ifndef IPMASQ_COMPAT

static __always_inline __u64 atomic_cas64(__u64 *p, __u64 old, __u64 new)
{
	return __sync_val_compare_and_swap(p, old, new);
}

static __always_inline __u64 atomic_fetch_add64(__u64 *p, __u64 d)
{
	return __sync_fetch_and_add(p, d);
}

static __always_inline void atomic_store64(__u64 *p, __u64 v)
{
	*(volatile __u64 *)p = v;
}

/* compat_coarse_ns is the records' clock: CLOCK_MONOTONIC at the tick's
 * resolution (lib/unmasq.h). */
static __always_inline __u64 compat_coarse_ns(void)
{
	return bpf_ktime_get_coarse_ns();
}

/* GLOBAL_FUNC heads a function the verifier checks once, whatever the
 * caller: a global function. */
#define GLOBAL_FUNC __noinline

/* AGENT_RUN(name, ctx_t) heads an agent's program (run with
 * BPF_PROG_TEST_RUN): a SEC("syscall") program that copies its context
 * (ctx_t, whose last field is __u32 result) to the stack, runs the body on
 * the copy as name##_run(ctx_t *c) and writes the body's result back. */
#define AGENT_RUN(name, ctx_t)						\
	static __always_inline __u32 name##_run(ctx_t *c);		\
	SEC("syscall") int name(ctx_t *ctx)				\
	{								\
		ctx_t c;						\
									\
		__builtin_memcpy(&c, ctx, sizeof(c));			\
		ctx->result = name##_run(&c);				\
		return 0;						\
	}								\
	static __always_inline __u32 name##_run(ctx_t *c)

#else /* IPMASQ_COMPAT */

struct atomic_lock_val {
	struct bpf_spin_lock lock;
};

/* The one lock of the compat build's atomics (see above). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct atomic_lock_val);
	__uint(max_entries, 1);
} atomic_lock SEC(".maps");

/* The lock's key, a read-only global: a key on the stack would add to the
 * frames of the functions the atomics are inlined in, and the IPv6 egress
 * chain is at the limit of 512 bytes on kernels that round every frame up
 * to 32 bytes (6.1). */
const volatile __u32 atomic_lock_key = 0;

static __always_inline struct atomic_lock_val *atomic_lock_get(void)
{
	return bpf_map_lookup_elem(&atomic_lock, (const void *)&atomic_lock_key);
}

/* atomic_cas64 stores new at *p if it holds old, and returns what it held.
 * Without the lock (never, an array of one) it stores nothing and returns
 * a value other than old: the caller's claim fails. */
static __always_inline __u64 atomic_cas64(__u64 *p, __u64 old, __u64 new)
{
	struct atomic_lock_val *l = atomic_lock_get();
	__u64 cur;

	if (!l)
		return ~old;
	bpf_spin_lock(&l->lock);
	cur = *(volatile __u64 *)p;
	if (cur == old)
		*(volatile __u64 *)p = new;
	bpf_spin_unlock(&l->lock);
	return cur;
}

static __always_inline __u64 atomic_fetch_add64(__u64 *p, __u64 d)
{
	struct atomic_lock_val *l = atomic_lock_get();
	__u64 cur;

	if (!l)
		return 0;
	bpf_spin_lock(&l->lock);
	cur = *(volatile __u64 *)p;
	*(volatile __u64 *)p = cur + d;
	bpf_spin_unlock(&l->lock);
	return cur;
}

/* atomic_store64 is a store to a word others swap: under the lock, so that
 * no swap's load and store fall on either side of it. */
static __always_inline void atomic_store64(__u64 *p, __u64 v)
{
	struct atomic_lock_val *l = atomic_lock_get();

	if (!l)
		return;
	bpf_spin_lock(&l->lock);
	*(volatile __u64 *)p = v;
	bpf_spin_unlock(&l->lock);
}

/* GLOBAL_FUNC: before 5.12 a global function takes no pointer but its
 * context; the functions are static in the compat build, checked at every
 * call with the caller's types. */
#define GLOBAL_FUNC static __noinline

/* Whether the kernel has bpf_ktime_get_coarse_ns (5.11), set by the loader
 * (Go: bpf.Load, a probe of the helper) before the programs load. A
 * constant: where it is 0 the verifier drops the call (a dead branch) and
 * 5.10, which has no such helper, loads the programs. */
const volatile __u32 compat_coarse_clock = 0;

/* compat_coarse_ns: the full build's clock where the kernel has it; before
 * 5.11 the same clock at full resolution (twice the cost). */
static __always_inline __u64 compat_coarse_ns(void)
{
	if (compat_coarse_clock)
		return bpf_ktime_get_coarse_ns();
	return bpf_ktime_get_ns();
}

/* AGENT_RUN_BAD_INPUT is the compat agent programs' return value for a
 * packet shorter than their context (Go: bpf/variant.go). */
#define AGENT_RUN_BAD_INPUT 0xffffffffU

/* AGENT_RUN: SEC("syscall") is 5.14: a tc program, its context the
 * packet's first bytes, its result the return value. */
#define AGENT_RUN(name, ctx_t)						\
	static __always_inline __u32 name##_run(ctx_t *c);		\
	SEC("tc") int name(struct __sk_buff *skb)			\
	{								\
		ctx_t c;						\
									\
		if (bpf_skb_load_bytes(skb, 0, &c, sizeof(c)))		\
			return AGENT_RUN_BAD_INPUT;			\
		return name##_run(&c);					\
	}								\
	static __always_inline __u32 name##_run(ctx_t *c)

#endif /* IPMASQ_COMPAT */

#endif /* IPMASQ_LIB_COMPAT_H */
