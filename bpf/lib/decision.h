/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Whether a new flow is masqueraded, and to which address.
 *
 * The SNAT address of a new flow is the kernel's own source selection for
 * the route the packet takes through this device (bpf_fib_lookup with
 * BPF_FIB_LOOKUP_SRC, from the source's point of view so ip rules apply):
 * the route's preferred source, else the device's address that fits the
 * next hop (IPv4) or RFC 6724's choice (IPv6), exactly what MASQUERADE
 * asks the kernel for. The pair keeps it for the flow's life. When the
 * lookup finds no route through the device, the device's primary address
 * (egress_devs) is used.
 */

#ifndef IPMASQ_LIB_DECISION_H
#define IPMASQ_LIB_DECISION_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"
#include "counters.h"
#include "maps.h"
#include "parse.h"
#include "fib.h"

#define FAMILY 4
#include "decision_fam.h"
#define FAMILY 6
#include "decision_fam.h"

#endif /* IPMASQ_LIB_DECISION_H */
