/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Fragments: the translation of a datagram's non-first fragments. */

#ifndef IPMASQ_LIB_FRAG_H
#define IPMASQ_LIB_FRAG_H

#include <linux/bpf.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "decision.h"
#include "rewrite.h"

/*
 * Fragments (IPv4 MF/offset, IPv6 fragment header): the first fragment holds
 * the L4 header and is translated like any packet of its flow, ports and L4
 * checksum included (the checksum covers the whole datagram, and the update
 * is a delta). It also records (src, dst, id, proto, dir) -> translated
 * address in frag_v4/frag_v6, and the later fragments get the L3 rewrite
 * only. A later fragment with no record (reordered before its first, or the
 * record evicted) is dropped on egress when its flow would be masqueraded,
 * so the pod address never leaves, and passed untouched on ingress. The
 * later fragments of a source that is no longer a masquerade source follow
 * their first fragment's record too (a former source's flow is translated
 * while it lasts, lib/hostflow.h); without a record they pass, as the
 * node's own do.
 */

#define FAMILY 4
#include "frag_fam.h"
#define FAMILY 6
#include "frag_fam.h"

#endif /* IPMASQ_LIB_FRAG_H */
