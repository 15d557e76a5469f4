/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Family templates: code written once for IPv4 and IPv6.
 *
 * A template (a lib/ file named *_fam.h) is included twice by its header,
 * after "#define FAMILY 4" and after "#define FAMILY 6", once the header
 * has included what the template uses. The template includes this file
 * first, which defines the macros below for that family, and again at its
 * end after "#undef FAMILY", which removes them. Hence no include guard.
 * Since the names it makes appear nowhere by name, a template lists them
 * in its header comment ("Defines: egress_v4, egress_v6."), so that grep
 * finds it; TestTemplatesNameWhatTheyDefine keeps the list exact.
 *
 *   FAM(name)            name_v4 / name_v6: the family's functions and maps
 *   FAM_T(a, b)          struct a_v4_b / struct a_v6_b: its keys and values
 *   FAM_ADDR             an address, addr4_t (__be32) / addr6_t (__u8[16]):
 *                        a parameter "const FAM_ADDR a" is passed by value
 *                        (IPv4) or by pointer (IPv6), with the same syntax
 *   FAM_PTR(a)           the bytes of address a: &(a) / (a)
 *   FAM_ADDR_COPY(d, s)  d = s, for addresses (d an lvalue)
 *   FAM_ADDR_EQ(a, b)    a == b, for addresses
 *   FAM_ADDR_LEN         4 / 16 bytes; FAM_ADDR_BITS: 32 / 128
 *   FAM_PKT(p)           the parsed packet's addresses: (p)->v4 / (p)->v6
 *   FAM_FIB(field)       bpf_fib_lookup's ipv4_field / ipv6_field
 *   FAM_AF               AF_INET / AF_INET6
 *   FAM_REWRITE(skb, p, field, from, to, proto, csum_off, port_off, pfrom, pto)
 *                        rewrite_v4/v6 of the packet's address field
 *                        (saddr or daddr), see rewrite.h
 *   FAM_IS_V6            0 / 1: the few lines that differ say so in place
 */

#undef FAM
#undef FAM_T
#undef FAM_ADDR
#undef FAM_PTR
#undef FAM_ADDR_COPY
#undef FAM_ADDR_EQ
#undef FAM_ADDR_LEN
#undef FAM_ADDR_BITS
#undef FAM_PKT
#undef FAM_FIB
#undef FAM_AF
#undef FAM_REWRITE
#undef FAM_IS_V6

#if !defined(FAMILY)
/* the end of a template: nothing defined */
#elif FAMILY == 4
#define FAM(name)		name##_v4
#define FAM_T(a, b)		struct a##_v4_##b
#define FAM_ADDR		addr4_t
#define FAM_PTR(a)		(&(a))
#define FAM_ADDR_COPY(d, s)	((d) = (s))
#define FAM_ADDR_EQ(a, b)	((a) == (b))
#define FAM_ADDR_LEN		4
#define FAM_ADDR_BITS		32
#define FAM_PKT(p)		((p)->v4)
#define FAM_FIB(field)		ipv4_##field
#define FAM_AF			AF_INET_
#define FAM_REWRITE(skb, p, field, from, to, proto, csum_off, port_off, pfrom, pto)	\
	rewrite_v4(skb, (p)->l3_off, (p)->l3_off + offsetof(struct iphdr, field), from, to,	\
		   proto, csum_off, port_off, pfrom, pto)
#define FAM_IS_V6		0
#elif FAMILY == 6
#define FAM(name)		name##_v6
#define FAM_T(a, b)		struct a##_v6_##b
#define FAM_ADDR		addr6_t
#define FAM_PTR(a)		(a)
#define FAM_ADDR_COPY(d, s)	__builtin_memcpy((d), (s), 16)
#define FAM_ADDR_EQ(a, b)	addr6_equal((a), (b))
#define FAM_ADDR_LEN		16
#define FAM_ADDR_BITS		128
#define FAM_PKT(p)		((p)->v6)
#define FAM_FIB(field)		ipv6_##field
#define FAM_AF			AF_INET6_
#define FAM_REWRITE(skb, p, field, from, to, proto, csum_off, port_off, pfrom, pto)	\
	rewrite_v6(skb, (p)->l3_off + offsetof(struct ipv6hdr, field), from, to,		\
		   proto, csum_off, port_off, pfrom, pto)
#define FAM_IS_V6		1
#else
#error "FAMILY must be 4 or 6"
#endif
