//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * A test program, not part of the datapath: nat_state() of lib/flow.h for
 * the protocol and flags in the packet's first two bytes, so that
 * TestStateOfIsNatState can hold bpf.StateOf to it (BPF_PROG_TEST_RUN).
 */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "../lib/flow.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

SEC("tc")
int nat_state_of(struct __sk_buff *skb)
{
	__u8 in[2];

	if (bpf_skb_load_bytes(skb, 0, in, sizeof(in)) < 0)
		return -1;
	return nat_state(in[0], in[1]);
}
