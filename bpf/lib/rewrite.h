/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Rewriting addresses and ports with their checksums. */

#ifndef IPMASQ_LIB_REWRITE_H
#define IPMASQ_LIB_REWRITE_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>

/* BPF_F_IPV6 for bpf_l4_csum_replace on IPv6 pseudo-header changes: without
 * it, kernels before 6.16 corrupt skb->csum of CHECKSUM_COMPLETE packets.
 * The loader clears it on kernels that reject the flag. */
const volatile __u64 csum_ipv6_flag = BPF_F_IPV6;

/*
 * The checksum helpers are used so that they stay right for every
 * skb->ip_summed: a changed address goes through bpf_l4_csum_replace with
 * BPF_F_PSEUDO_HDR (for CHECKSUM_PARTIAL only the pseudo-header sum in the
 * checksum field is updated), a changed port without it (ignored for
 * CHECKSUM_PARTIAL, the device sums the payload later). UDP uses
 * BPF_F_MARK_MANGLED_0 so that a zero "no checksum" stays zero and a computed
 * zero becomes 0xffff.
 */

/* rewrite_port replaces the port or echo identifier at port_off and fixes
 * the L4 checksum at csum_off (no pseudo header: ports are not in it). */
static __always_inline int rewrite_port(struct __sk_buff *skb, __u32 csum_off, __u32 port_off,
					__be16 pfrom, __be16 pto, __u64 mangled)
{
	if (pfrom == pto)
		return 0;
	if (bpf_l4_csum_replace(skb, csum_off, pfrom, pto, mangled | 2) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, port_off, &pto, 2, 0) < 0)
		return -1;
	return 0;
}

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
		if (rewrite_port(skb, csum_off, port_off, pfrom, pto, mangled) < 0)
			return -1;
	}
	if (bpf_l3_csum_replace(skb, l3_off + offsetof(struct iphdr, check), from, to, 4) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, addr_off, &to, 4, 0) < 0)
		return -1;
	return 0;
}

/* rewrite_v6 is rewrite_v4 for IPv6: no header checksum, and ICMPv6 does
 * have a pseudo header. from and to point to 16-byte copies on the stack, so
 * that the checksum change and the bytes written agree. */
static __always_inline int rewrite_v6(struct __sk_buff *skb, __u32 addr_off, const __u8 *from,
				      const __u8 *to,
				      __u8 proto, __u32 csum_off, __u32 port_off,
				      __be16 pfrom, __be16 pto)
{
	__u64 mangled = proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;

	if (csum_off) {
		__s64 diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);

		if (bpf_l4_csum_replace(skb, csum_off, 0, (__u32)diff,
					BPF_F_PSEUDO_HDR | csum_ipv6_flag | mangled) < 0)
			return -1;
		if (rewrite_port(skb, csum_off, port_off, pfrom, pto, mangled) < 0)
			return -1;
	}
	if (bpf_skb_store_bytes(skb, addr_off, to, 16, 0) < 0)
		return -1;
	return 0;
}

#endif /* IPMASQ_LIB_REWRITE_H */
