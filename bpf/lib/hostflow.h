/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The node's own flows: tuples held from NAT, and remapped clashes. */

#ifndef IPMASQ_LIB_HOSTFLOW_H
#define IPMASQ_LIB_HOSTFLOW_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "types.h"
#include "compat.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "flow.h"
#include "frag.h"
#include "ports.h"

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

/*
 * A source that stops being a masquerade source (a pod CIDR or a masquerade
 * rule removed) keeps its running flows translated until they end, as Linux
 * keeps a conntrack entry's NAT: its packets come here like the node's
 * (they are not a masquerade source's), find their dir-0 entry and are
 * translated by it; new flows of such a source are not masqueraded. This
 * costs the node's and other non-masquerade sources' TCP/UDP packets one
 * NAT lookup (the node's own paid it already).
 */

/* host_flow_* results. */
#define HOST_PASS	0	/* leaves untouched */
#define HOST_PAIR	1	/* has a NAT pair, or needs one: translated like a pod's flow */
#define HOST_FORMER	2	/* a former masquerade source's NAT pair: translated while it lasts, never made anew */

#define FAMILY 4
#include "hostflow_fam.h"
#define FAMILY 6
#include "hostflow_fam.h"

#endif /* IPMASQ_LIB_HOSTFLOW_H */
