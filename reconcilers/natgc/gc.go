package natgc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"

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

// collector frees expired NAT pairs and inbound flow records. The programs
// apply the lifetimes on their own (an expired pair is reopened, taken over
// or early-dropped when its tuple or room is wanted), so the collector only
// gives the memory back, and it does so at a cost that does not grow with
// the flows: each round reads at most gcScanPerRound entries of each map,
// from where the last round stopped (the batch cursor is a bucket index, so
// a round resumes where the map's buckets left off whatever came and went
// meanwhile), as conntrack's gc_worker bounds each of its runs. A map of
// up to gcScanPerRound entries is read whole every round; a larger one in
// size/gcScanPerRound rounds.
//
// An entry is a candidate when it has outlived the lifetime of its own
// state, read from its own flags: a pair's state is the state of one of its
// halves (the one with the highest-ranking flag, see nat_state), and the
// pair's last packet is no older than that half's, so every expired pair
// has a half that is a candidate by itself, and no other half needs
// reading (which cost a lookup a round for every idle pair). An egress
// entry without FIN or RST never ranks above its reply entry (SEEN and the
// UDP stream mark live there), so it is a candidate only past the longest
// lifetime of its protocol: an idle established pair's egress entry costs
// nothing either, and one whose reply entry was lost is still freed. Each
// candidate is ended by the kernel (bpf.Datapath.EndPairV4/V6), which
// judges the pair, both halves, at that instant and claims it as the
// programs do before deleting both halves, so a packet, a SYN that
// reopened the pair or a flow that took its port over since the scan keeps
// it or its new entries. Pairs translated to an address the node no longer
// has (deleted from its device) are removed as they are read, as
// MASQUERADE ends such flows: they would keep sending from an address
// nobody answers. Adding or reordering addresses ends nothing.
type collector struct {
	log       *slog.Logger
	dp        *datapath.Handle
	lifetimes bpf.Lifetimes
	// snat returns the addresses pairs may keep (the node's addresses and
	// the rules' toAddress), or ok=false while they are not known yet (then
	// nothing is removed for that reason).
	snat func() (addrs map[netip.Addr]bool, ok bool)

	mu       sync.Mutex // one round at a time: the timer's and the command's
	scan4    scanner[bpf.NATKeyV4, bpf.NATValV4]
	scan6    scanner[bpf.NATKeyV6, bpf.NATValV6]
	perRound int // 0: gcScanPerRound
}

// GCStats says what one collection did: entries read, and pairs (or
// inbound records) ended; Wrapped: the round reached the end of the map
// (the next starts again from its first bucket).
type GCStats struct {
	Entries, Expired int
	Wrapped          bool
}

// endFunc ends the pair of a key in the kernel if it is still expired, or
// whatever its age with force (bpf.Datapath.EndPairV4/V6).
type endFunc[K any] func(k K, force bool) (bpf.GCResult, error)

// collect is the timer's round: at most gcScanPerRound entries of each map.
func (c *collector) collect(ctx context.Context) error {
	_, _, err := c.round()
	return err
}

// collectNow (datapath/gc) sweeps both maps whole, in rounds, from where
// the last round stopped.
func (c *collector) collectNow() error {
	if c.dp.Get() == nil {
		return nil
	}
	for done4, done6 := false, false; !done4 || !done6; {
		s4, s6, err := c.round()
		if err != nil {
			return err
		}
		done4, done6 = done4 || s4.Wrapped, done6 || s6.Wrapped
	}
	return nil
}

func (c *collector) round() (s4, s6 GCStats, err error) {
	dp := c.dp.Get()
	if dp == nil {
		return s4, s6, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var snat map[netip.Addr]bool
	if c.snat != nil {
		if addrs, ok := c.snat(); ok {
			snat = addrs
		}
	}
	budget := cmp.Or(c.perRound, gcScanPerRound)
	now := bpf.KtimeNow()
	s4, err4 := c.scan4.round(dp.Maps.NatV4, bpf.MapNATV4, dp.EndPairV4, c.lifetimes, now, snat, describeV4, budget)
	s6, err6 := c.scan6.round(dp.Maps.NatV6, bpf.MapNATV6, dp.EndPairV6, c.lifetimes, now, snat, describeV6, budget)
	if c.log != nil && s4.Expired+s6.Expired > 0 {
		c.log.Debug("NAT entries expired", "ipv4", s4.Expired, "ipv6", s6.Expired)
	}
	return s4, s6, errors.Join(err4, err6)
}

// natEntry is what the collector needs to know of one NAT entry.
type natEntry struct {
	proto    uint8
	dir      uint8
	flags    uint8
	lastSeen uint64
	snat     netip.Addr // the SNAT address of the pair
}

func describeV4(k bpf.NATKeyV4, v bpf.NATValV4) natEntry {
	e := natEntry{proto: k.Proto, dir: k.Dir, flags: v.Flags, lastSeen: v.LastSeenNs}
	switch k.Dir {
	case bpf.DirInbound:
		// no SNAT address
	case bpf.DirEgress:
		e.snat = bpf.AddrFrom4(v.Addr)
	default:
		e.snat = bpf.AddrFrom4(k.Dst)
	}
	return e
}

func describeV6(k bpf.NATKeyV6, v bpf.NATValV6) natEntry {
	e := natEntry{proto: k.Proto, dir: k.Dir, flags: v.Flags, lastSeen: v.LastSeenNs}
	switch k.Dir {
	case bpf.DirInbound:
	case bpf.DirEgress:
		e.snat = netip.AddrFrom16(v.Addr)
	default:
		e.snat = netip.AddrFrom16(k.Dst)
	}
	return e
}

// collectV4 sweeps nat_v4 whole (in rounds of budget entries; 0: all at
// once), expiring pairs and inbound records that outlived their state's
// lifetime as of now() (monotonic ns), and pairs whose SNAT address is not
// in snat (when snat is not nil), through end.
func collectV4(m *ebpf.Map, end endFunc[bpf.NATKeyV4], l bpf.Lifetimes, now func() uint64,
	snat map[netip.Addr]bool) (GCStats, error) {
	var s scanner[bpf.NATKeyV4, bpf.NATValV4]
	return s.sweep(m, bpf.MapNATV4, end, l, now, snat, describeV4)
}

// gcChunk is how many entries one batch read returns.
const gcChunk = 4096

// gcScanPerRound bounds the entries of each map one round reads: the
// collector's CPU a round, whatever the number of flows (a batch read of
// 64 Ki entries and at most as many kernel judgments: about 10 ms here).
// A full sweep of the default 524 288 entries takes 8 rounds (80 s at the
// default --nat-gc-interval); until then an expired pair only holds
// memory, not its tuple (the programs reuse or drop it when wanted).
const gcScanPerRound = 16 * gcChunk

// scanner is one map's position between rounds, and its buffers.
type scanner[K comparable, V any] struct {
	cursor ebpf.MapBatchCursor
	keys   []K
	vals   []V
}

// sweep runs rounds of the whole map until one reaches its end.
func (s *scanner[K, V]) sweep(m *ebpf.Map, name string, end endFunc[K], l bpf.Lifetimes, clock func() uint64,
	snat map[netip.Addr]bool, describe func(K, V) natEntry) (GCStats, error) {
	var total GCStats
	for {
		st, err := s.round(m, name, end, l, clock(), snat, describe, gcScanPerRound)
		total.Entries += st.Entries
		total.Expired += st.Expired
		if err != nil || st.Wrapped {
			total.Wrapped = st.Wrapped
			return total, err
		}
	}
}

// round reads at most budget entries (rounded up to a batch) from where
// the last round stopped, and ends the candidates among them.
func (s *scanner[K, V]) round(m *ebpf.Map, name string, end endFunc[K], l bpf.Lifetimes, now uint64,
	snat map[netip.Addr]bool, describe func(K, V) natEntry, budget int) (GCStats, error) {
	var (
		stats   GCStats
		expired []candidate[K]
		longest longestLifetimes
	)
	if s.keys == nil {
		s.keys, s.vals = make([]K, gcChunk), make([]V, gcChunk)
	}
	for stats.Entries < budget {
		n, err := m.BatchLookup(&s.cursor, s.keys, s.vals, nil)
		done := errors.Is(err, ebpf.ErrKeyNotExist)
		if err != nil && !done {
			s.cursor = ebpf.MapBatchCursor{}
			return stats, fmt.Errorf("read %s: %w", name, err)
		}
		for i := range n {
			stats.Entries++
			e := describe(s.keys[i], s.vals[i])
			switch {
			case e.dir != bpf.DirInbound && snat != nil && !snat[e.snat]:
				expired = append(expired, candidate[K]{s.keys[i], true})
			case candidateEntry(l, now, e, &longest):
				expired = append(expired, candidate[K]{s.keys[i], false})
			}
		}
		if done {
			s.cursor = ebpf.MapBatchCursor{}
			stats.Wrapped = true
			break
		}
	}
	// The kernel judges each again, with the pair's other half, and
	// deletes it only if still expired: never by key from here, where a
	// SYN may have reopened the pair or a new flow taken its port since
	// the scan. Both halves of a pair may be candidates; the second finds
	// its pair gone.
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

// candidate is a key the scan found expired (or force: its SNAT address
// is gone).
type candidate[K any] struct {
	key   K
	force bool
}

// candidateEntry says whether the scan offers e to the kernel: see
// collector.
func candidateEntry(l bpf.Lifetimes, now uint64, e natEntry, longest *longestLifetimes) bool {
	if e.dir == bpf.DirEgress && e.flags&(bpf.NATFlagFIN|bpf.NATFlagRST) == 0 {
		return age(now, e.lastSeen) > longest.of(l, e.proto)
	}
	return expiredAt(l, now, e.lastSeen, e.proto, e.flags)
}

// longestLifetimes memoizes the longest lifetime of each protocol's pairs.
type longestLifetimes struct {
	known [256]bool
	d     [256]time.Duration
}

func (m *longestLifetimes) of(l bpf.Lifetimes, proto uint8) time.Duration {
	if !m.known[proto] {
		for flags := range 256 {
			m.d[proto] = max(m.d[proto], l.Of(bpf.StateOf(proto, uint8(flags))))
		}
		m.known[proto] = true
	}
	return m.d[proto]
}

// expiredAt says whether an entry last seen at last has outlived its state.
func expiredAt(l bpf.Lifetimes, now, last uint64, proto, flags uint8) bool {
	return age(now, last) > l.Of(bpf.StateOf(proto, flags))
}

// age is how long before now a stamp was, signed as the programs compare
// (nat_age in lib/flow.h): a stamp after now (written since now was read,
// or a claimed entry's) is negative.
func age(now, stamp uint64) time.Duration {
	return time.Duration(int64(now - stamp))
}
