package natgc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/reconcilers/datapath"
)

const (
	protoICMP   = bpf.ProtoICMP
	protoTCP    = bpf.ProtoTCP
	protoUDP    = bpf.ProtoUDP
	protoICMPv6 = bpf.ProtoICMPv6
	protoSCTP   = 132
)

// monotonicNow is the clock of bpf_ktime_get_ns.
func monotonicNow() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// collector frees expired NAT pairs and inbound flow records. Both
// directions of a pair are judged together: a pair has expired when neither
// direction has seen a packet for the lifetime of the pair's state (the
// programs apply the same lifetimes on their own, so a late collection never
// keeps a port or a flow). The scan only finds candidates: each is ended by
// the kernel (bpf.Datapath.EndPairV4/V6), which judges the pair again at
// that instant and claims it as the programs do before deleting both
// halves, so a packet, a SYN that reopened the pair or a flow that took its
// port over since the scan keeps it or its new entries. Pairs translated to
// an address the node no longer has (deleted from its device) are removed
// at once, as MASQUERADE ends such flows: they would keep sending from an
// address nobody answers. Adding or reordering addresses ends nothing.
type collector struct {
	log       *slog.Logger
	dp        *datapath.Handle
	lifetimes bpf.Lifetimes
	// snat returns the addresses pairs may keep (the node's addresses and
	// the rules' toAddress), or ok=false while they are not known yet (then
	// nothing is removed for that reason).
	snat func() (addrs map[netip.Addr]bool, ok bool)
}

// GCStats says what one collection did: entries read, and pairs (or
// inbound records) ended.
type GCStats struct {
	Entries, Expired int
}

// endFunc ends the pair of a key in the kernel if it is still expired, or
// whatever its age with force (bpf.Datapath.EndPairV4/V6).
type endFunc[K any] func(k K, force bool) (bpf.GCResult, error)

func (c *collector) collect(ctx context.Context) error { return c.collectNow() }

func (c *collector) collectNow() error {
	dp := c.dp.Get()
	if dp == nil {
		return nil
	}
	var snat map[netip.Addr]bool
	if c.snat != nil {
		if addrs, ok := c.snat(); ok {
			snat = addrs
		}
	}
	s4, err4 := collectV4(dp.Maps.NatV4, dp.EndPairV4, c.lifetimes, monotonicNow, snat)
	s6, err6 := collectV6(dp.Maps.NatV6, dp.EndPairV6, c.lifetimes, monotonicNow, snat)
	if c.log != nil && s4.Expired+s6.Expired > 0 {
		c.log.Debug("NAT entries expired", "ipv4", s4.Expired, "ipv6", s6.Expired)
	}
	return errors.Join(err4, err6)
}

// natEntry is what the collector needs to know of one NAT entry.
type natEntry[K comparable] struct {
	peer     K // the key of the other direction
	proto    uint8
	dir      uint8
	flags    uint8
	lastSeen uint64
	snat     netip.Addr // the SNAT address of the pair
}

func describeV4(k bpf.NATKeyV4, v bpf.NATValV4) natEntry[bpf.NATKeyV4] {
	e := natEntry[bpf.NATKeyV4]{peer: bpf.PeerV4(k, v), proto: k.Proto, dir: k.Dir, flags: v.Flags, lastSeen: v.LastSeenNs}
	switch k.Dir {
	case bpf.DirInbound:
		e.peer = k // no other direction, and no SNAT address
	case bpf.DirEgress:
		e.snat = bpf.AddrFrom4(v.Addr)
	default:
		e.snat = bpf.AddrFrom4(k.Dst)
	}
	return e
}

func describeV6(k bpf.NATKeyV6, v bpf.NATValV6) natEntry[bpf.NATKeyV6] {
	e := natEntry[bpf.NATKeyV6]{peer: bpf.PeerV6(k, v), proto: k.Proto, dir: k.Dir, flags: v.Flags, lastSeen: v.LastSeenNs}
	switch k.Dir {
	case bpf.DirInbound:
		e.peer = k // no other direction, and no SNAT address
	case bpf.DirEgress:
		e.snat = netip.AddrFrom16(v.Addr)
	default:
		e.snat = netip.AddrFrom16(k.Dst)
	}
	return e
}

// collectV4 expires IPv4 pairs and inbound records that outlived their
// state's lifetime as of now() (monotonic ns), and pairs whose SNAT address
// is not in snat (when snat is not nil), through end.
func collectV4(m *ebpf.Map, end endFunc[bpf.NATKeyV4], l bpf.Lifetimes, now func() uint64,
	snat map[netip.Addr]bool) (GCStats, error) {
	return collectMap(m, bpf.MapNATV4, end, l, now, snat, describeV4)
}

// collectV6 is collectV4 for IPv6.
func collectV6(m *ebpf.Map, end endFunc[bpf.NATKeyV6], l bpf.Lifetimes, now func() uint64,
	snat map[netip.Addr]bool) (GCStats, error) {
	return collectMap(m, bpf.MapNATV6, end, l, now, snat, describeV6)
}

// gcChunk is how many entries one batch read returns, and how many expired
// entries one pass deletes at most: the collector's memory is bounded by it,
// whatever the size of the map (the rest go in the next passes).
const gcChunk = 4096

// gcMaxExpiredPerPass bounds the keys a pass holds for deletion.
const gcMaxExpiredPerPass = 64 * gcChunk

// candidate is a key the scan found expired (or force: its SNAT address
// is gone).
type candidate[K any] struct {
	key   K
	force bool
}

func collectMap[K comparable, V comparable](m *ebpf.Map, name string, end endFunc[K], l bpf.Lifetimes,
	clock func() uint64, snat map[netip.Addr]bool, describe func(K, V) natEntry[K]) (GCStats, error) {
	now := clock()
	var (
		stats   GCStats
		expired []candidate[K]
		cursor  ebpf.MapBatchCursor
		keys    = make([]K, gcChunk)
		vals    = make([]V, gcChunk)
	)
	// The map is read in batches and judged as it goes: an entry's own
	// idle time against the shortest lifetime its pair can have says
	// whether its other half is worth a lookup. Memory stays at one batch
	// plus the expired keys, however large the map.
	for len(expired) < gcMaxExpiredPerPass {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		done := errors.Is(err, ebpf.ErrKeyNotExist)
		if err != nil && !done {
			return stats, fmt.Errorf("read %s: %w", name, err)
		}
		for i := range n {
			stats.Entries++
			e := describe(keys[i], vals[i])
			if e.dir != bpf.DirInbound && snat != nil && !snat[e.snat] {
				expired = append(expired, candidate[K]{keys[i], true})
				continue
			}
			if age(now, e.lastSeen) <= shortestLifetime(l, e.proto, e.flags) {
				continue
			}
			if pairExpired(m, l, now, keys[i], e, describe) {
				expired = append(expired, candidate[K]{keys[i], false})
			}
		}
		if done {
			break
		}
	}
	// The kernel judges each again and deletes it only if still expired:
	// never by key from here, where a SYN may have reopened the pair or a
	// new flow taken its port since the scan. Both halves of a pair are
	// candidates; the second finds its pair gone.
	var errs []error
	for _, c := range expired {
		res, err := end(c.key, c.force)
		if err != nil {
			errs = append(errs, fmt.Errorf("end a pair of %s: %w", name, err))
			if len(errs) > 10 {
				break
			}
			continue
		}
		if res == bpf.GCEnded {
			stats.Expired++
		}
	}
	return stats, errors.Join(errs...)
}

// pairExpired judges an entry together with its other half, read now.
func pairExpired[K comparable, V comparable](m *ebpf.Map, l bpf.Lifetimes, now uint64, k K, e natEntry[K],
	describe func(K, V) natEntry[K]) bool {
	last, flags := e.lastSeen, e.flags
	if e.peer != k {
		if p, ok := lookupEntry(m, e.peer, describe); ok {
			if age(p.lastSeen, last) > 0 {
				last = p.lastSeen
			}
			flags |= p.flags
		}
	}
	return expiredAt(l, now, last, e.proto, flags)
}

// shortestLifetime is the shortest lifetime a pair can have given the flags
// one of its entries carries (the other half may add flags): an entry idle
// for less than that cannot belong to an expired pair. It is derived from
// StateOf, whose state is decided by the highest-ranking flag present, so
// adding one flag at a time reaches every state more flags can reach.
func shortestLifetime(l bpf.Lifetimes, proto, flags uint8) time.Duration {
	shortest := l.Of(bpf.StateOf(proto, flags))
	for bit := 0; bit < 8; bit++ {
		shortest = min(shortest, l.Of(bpf.StateOf(proto, flags|1<<bit)))
	}
	return shortest
}

func lookupEntry[K comparable, V comparable](m *ebpf.Map, k K, describe func(K, V) natEntry[K]) (natEntry[K], bool) {
	var v V
	if err := m.Lookup(k, &v); err != nil {
		return natEntry[K]{}, false
	}
	return describe(k, v), true
}

// expiredAt says whether a pair last seen at last has outlived its state.
func expiredAt(l bpf.Lifetimes, now, last uint64, proto, flags uint8) bool {
	return age(now, last) > l.Of(bpf.StateOf(proto, flags))
}

// age is how long before now a stamp was, signed as the programs compare
// (nat_age in lib/flow.h): a stamp after now (written since now was read,
// or a claimed entry's) is negative.
func age(now, stamp uint64) time.Duration {
	return time.Duration(int64(now - stamp))
}
