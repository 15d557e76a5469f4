package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// Counter indexes the per-CPU "counters" map. The values mirror enum counter
// in lib/counters.h.
type Counter uint32

// Counters, in map order.
const (
	CounterMasqueraded        = Counter(masqCounterCOUNTER_MASQUERADED)
	CounterNATNew             = Counter(masqCounterCOUNTER_NAT_NEW)
	CounterSkipNonMasqDst     = Counter(masqCounterCOUNTER_SKIP_NONMASQ_DST)
	CounterSkipNodeDst        = Counter(masqCounterCOUNTER_SKIP_NODE_DST)
	CounterSkipNotSource      = Counter(masqCounterCOUNTER_SKIP_NOT_SOURCE)
	CounterSkipNoSNATAddr     = Counter(masqCounterCOUNTER_SKIP_NO_SNAT_ADDR)
	CounterDropUntranslatable = Counter(masqCounterCOUNTER_DROP_UNTRANSLATABLE)
	CounterReverse            = Counter(masqCounterCOUNTER_REVERSE)
	CounterICMPErrorReverse   = Counter(masqCounterCOUNTER_ICMP_ERR_REVERSE)
	CounterNATFull            = Counter(masqCounterCOUNTER_NAT_FULL)
	CounterNoPort             = Counter(masqCounterCOUNTER_NO_PORT)
	CounterFragments          = Counter(masqCounterCOUNTER_FRAGMENTS)
	CounterFragUnknown        = Counter(masqCounterCOUNTER_FRAG_UNKNOWN)
	CounterError              = Counter(masqCounterCOUNTER_ERROR)
	CounterNATNewByRule       = Counter(masqCounterCOUNTER_NAT_NEW_BY_RULE)
	CounterInboundNew         = Counter(masqCounterCOUNTER_INBOUND_NEW)
	CounterSkipInboundReply   = Counter(masqCounterCOUNTER_SKIP_INBOUND_REPLY)
	CounterSkipNotFlowStart   = Counter(masqCounterCOUNTER_SKIP_NOT_FLOW_START)
	CounterNATReopened        = Counter(masqCounterCOUNTER_NAT_REOPENED)
	CounterNATReused          = Counter(masqCounterCOUNTER_NAT_REUSED)
	CounterDropNoSNATAddr     = Counter(masqCounterCOUNTER_DROP_NO_SNAT_ADDR)
	CounterICMPErrorEgress    = Counter(masqCounterCOUNTER_ICMP_ERR_EGRESS)
	CounterICMPErrorUnknown   = Counter(masqCounterCOUNTER_ICMP_ERR_UNMATCHED)
	CounterNATNewSCTP         = Counter(masqCounterCOUNTER_NAT_NEW_SCTP)
	CounterNATNewAddrOnly     = Counter(masqCounterCOUNTER_NAT_NEW_ADDR_ONLY)
	CounterPairTaken          = Counter(masqCounterCOUNTER_PAIR_TAKEN)
	CounterHostFlowNew        = Counter(masqCounterCOUNTER_HOST_FLOW_NEW)
	CounterNATPortKept        = Counter(masqCounterCOUNTER_NAT_PORT_KEPT)
	CounterHostFlowRemapped   = Counter(masqCounterCOUNTER_HOST_FLOW_REMAPPED)
	CounterNATPickedUp        = Counter(masqCounterCOUNTER_NAT_PICKED_UP)
	CounterDropNoPair         = Counter(masqCounterCOUNTER_DROP_NO_PAIR)
	CounterFormerSource       = Counter(masqCounterCOUNTER_FORMER_SOURCE)
	CounterNATEarlyDrop       = Counter(masqCounterCOUNTER_NAT_EARLY_DROP)
	CounterDropPairClaimed    = Counter(masqCounterCOUNTER_DROP_PAIR_CLAIMED)
	CounterUnmasqNew          = Counter(masqCounterCOUNTER_UNMASQ_NEW)
	CounterTCPRSTIgnored      = Counter(masqCounterCOUNTER_TCP_RST_IGNORED)
	CounterDropHandback       = Counter(masqCounterCOUNTER_DROP_HANDBACK)

	// NumCounters is the number of counters (the map's max_entries).
	NumCounters = Counter(masqCounterCOUNTER_MAX)
)

var counterNames = [NumCounters]string{
	CounterMasqueraded:        "masqueraded",
	CounterNATNew:             "nat-new",
	CounterSkipNonMasqDst:     "skip-nonmasq-destination",
	CounterSkipNodeDst:        "skip-node-destination",
	CounterSkipNotSource:      "skip-not-masq-source",
	CounterSkipNoSNATAddr:     "skip-no-snat-address",
	CounterDropUntranslatable: "drop-untranslatable",
	CounterReverse:            "reverse-translated",
	CounterICMPErrorReverse:   "icmp-error-reverse-translated",
	CounterNATFull:            "drop-nat-table-full",
	CounterNoPort:             "drop-no-free-port",
	CounterFragments:          "fragments-translated",
	CounterFragUnknown:        "drop-fragment-unknown",
	CounterError:              "error",
	CounterNATNewByRule:       "nat-new-by-rule",
	CounterInboundNew:         "inbound-new",
	CounterSkipInboundReply:   "skip-inbound-reply",
	CounterSkipNotFlowStart:   "skip-not-flow-start",
	CounterNATReopened:        "nat-reopened",
	CounterNATReused:          "nat-port-reused",
	CounterDropNoSNATAddr:     "drop-no-snat-address",
	CounterICMPErrorEgress:    "icmp-error-translated",
	CounterICMPErrorUnknown:   "drop-icmp-error-unmatched",
	CounterNATNewSCTP:         "nat-new-sctp",
	CounterNATNewAddrOnly:     "nat-new-address-only",
	CounterPairTaken:          "drop-pair-taken",
	CounterHostFlowNew:        "host-flow-new",
	CounterNATPortKept:        "nat-source-port-kept",
	CounterHostFlowRemapped:   "host-flow-remapped",
	CounterNATPickedUp:        "nat-picked-up",
	CounterDropNoPair:         "drop-no-pair",
	CounterFormerSource:       "former-source-translated",
	CounterNATEarlyDrop:       "nat-early-drop",
	CounterDropPairClaimed:    "drop-pair-claimed",
	CounterUnmasqNew:          "unmasq-new",
	CounterTCPRSTIgnored:      "tcp-rst-ignored",
	CounterDropHandback:       "drop-handback",
}

// String returns the counter's name as shown to operators.
func (c Counter) String() string {
	if c < NumCounters {
		return counterNames[c]
	}
	return fmt.Sprintf("counter-%d", uint32(c))
}

// ReadCounters sums the per-CPU values of a counters map (Datapath.Maps.Counters
// or the pinned map opened with ebpf.LoadPinnedMap), indexed by Counter.
func ReadCounters(m *ebpf.Map) ([]uint64, error) {
	out, err := SumPerCPU(m, min(int(NumCounters), int(m.MaxEntries())))
	if err != nil {
		return nil, fmt.Errorf("read counters: %w", err)
	}
	return append(out, make([]uint64, int(NumCounters)-len(out))...), nil
}

// SumPerCPU returns the values of keys 0 to n-1 of a per-CPU array of
// uint64, each summed over CPUs (mod 2^64): one batch read for them all
// (BPF_MAP_LOOKUP_BATCH), or one lookup per key on a kernel without batch
// reads of arrays. A scrape reads the counters this way, so that its cost
// is a few syscalls, not one per counter.
func SumPerCPU(m *ebpf.Map, n int) ([]uint64, error) {
	if m.Type() != ebpf.PerCPUArray || m.ValueSize() != 8 {
		return nil, fmt.Errorf("%s is a %s of %d-byte values, not a per-CPU array of uint64", m, m.Type(), m.ValueSize())
	}
	if n > int(m.MaxEntries()) {
		return nil, fmt.Errorf("%s has %d entries, not %d", m, m.MaxEntries(), n)
	}
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, err
	}
	out := make([]uint64, n)
	keys := make([]uint32, n)
	vals := make([]uint64, n*cpus)
	var cursor ebpf.MapBatchCursor
	// An array's batch read starts at key 0 and returns the keys in order;
	// it may return fewer than asked, so read on from the cursor.
	for read := 0; read < n; {
		got, err := m.BatchLookup(&cursor, keys[read:], vals[read*cpus:], nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			return sumPerCPUByKey(m, n)
		}
		for i := read; i < read+got; i++ {
			k := int(keys[i])
			if k >= n {
				continue
			}
			for _, v := range vals[i*cpus : (i+1)*cpus] {
				out[k] += v
			}
		}
		read += got
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			if read < n {
				return nil, fmt.Errorf("read %s: %d of %d keys", m, read, n)
			}
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", m, err)
		}
		if got == 0 {
			return nil, fmt.Errorf("read %s: the batch read returned nothing after %d of %d keys", m, read, n)
		}
	}
	return out, nil
}

// sumPerCPUByKey is SumPerCPU one lookup per key.
func sumPerCPUByKey(m *ebpf.Map, n int) ([]uint64, error) {
	out := make([]uint64, n)
	var perCPU []uint64
	for k := range n {
		if err := m.Lookup(uint32(k), &perCPU); err != nil {
			return nil, fmt.Errorf("read %s key %d: %w", m, k, err)
		}
		for _, v := range perCPU {
			out[k] += v
		}
	}
	return out, nil
}
