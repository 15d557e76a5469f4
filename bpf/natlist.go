package bpf

import (
	"errors"
	"fmt"
	"math/bits"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// NATKind says what a listed NAT record is.
type NATKind uint8

// Kinds of NAT records.
const (
	// KindMasquerade is a translated flow: its egress entry (the source's
	// tuple → SNAT address and port) with its reply entry.
	KindMasquerade NATKind = iota
	// KindInbound is a flow a remote opened toward a masquerade source:
	// recorded so that its answers are not masqueraded, never translated.
	KindInbound
	// KindHost is a node socket's flow from a port of the NAT range: its
	// reply tuple is held so that no NAT pair takes it; never translated.
	KindHost
)

var kindNames = [...]string{KindMasquerade: "masquerade", KindInbound: "inbound", KindHost: "host"}

func (k NATKind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("kind-%d", uint8(k))
}

// NATPair is one flow as the NAT maps hold it, both directions joined.
//
// The NAT entries hold no packet or byte counters: the programs write an
// entry only when its state changes or once a second (last_seen), and a
// per-packet counter would be a write on every packet of every flow.
type NATPair struct {
	Kind  NATKind
	IPv6  bool
	Proto uint8
	// Src and Dst are the original tuple: the source's (pod's) address and
	// port and the remote's. For KindInbound the remote is Src.
	Src, Dst netip.AddrPort
	// Translated is the source the remote sees (SNAT address and port);
	// invalid for KindInbound and KindHost, which are not translated.
	Translated netip.AddrPort
	// Flags are both directions' NATFlag* bits; State derives from them.
	Flags uint8
	State NATState
	// CreatedNs and LastSeenNs are bpf_ktime_get_ns (CLOCK_MONOTONIC)
	// times: the pair's start (or last reopening) and its last packet in
	// either direction (refreshed at most once a second).
	CreatedNs, LastSeenNs uint64
	// ReplyMissing: a masquerade pair whose reply entry is gone; its next
	// packet from the source restores it (lib/flow_fam.h).
	ReplyMissing bool
	// Conntrack: a masquerade pair whose translation conntrack may hold
	// (adopted from it, or handed back to it: lib/handover.h); its
	// replies are left to conntrack while conntrack has the flow.
	Conntrack bool
}

// KtimeNow is the clock of the programs' bpf_ktime_get_ns (CLOCK_MONOTONIC),
// the clock of [NATPair.CreatedNs] and [NATPair.LastSeenNs].
func KtimeNow() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// Age is how long the pair has existed at now (monotonic ns).
func (p *NATPair) Age(now uint64) time.Duration {
	if now <= p.CreatedNs {
		return 0
	}
	return time.Duration(now - p.CreatedNs)
}

// ExpiresIn is how long the pair lives without a packet at now under l;
// zero or less: expired, its memory freed by the next collection and its
// port free for a new flow.
func (p *NATPair) ExpiresIn(l Lifetimes, now uint64) time.Duration {
	idle := time.Duration(0)
	if now > p.LastSeenNs {
		idle = time.Duration(now - p.LastSeenNs)
	}
	return l.Of(p.State) - idle
}

// natReadChunk is how many entries one batch read returns.
const natReadChunk = 4096

// natListChunk is how many entries one batch read of the listing returns:
// larger than natReadChunk, since the listing reads the whole map at once
// (1.5 MiB of IPv4 entries a read, a tenth less CPU a pass than 4 096).
const natListChunk = 32768

// ReadNATPairsV4 calls visit for every pair, inbound record and node flow
// hold of nat_v4, until visit returns false. The map is read once in
// batches, and each egress entry joined to its reply entry in user space
// (readNATPairs). The order: inbound records and node flow holds first,
// in map order, then the pairs, by the hash of their reply key.
func ReadNATPairsV4(m *ebpf.Map, visit func(*NATPair) bool) error {
	return readNATPairs(m, natV4, 0, visit)
}

// ReadNATPairsV6 is ReadNATPairsV4 for nat_v6.
func ReadNATPairsV6(m *ebpf.Map, visit func(*NATPair) bool) error {
	return readNATPairs(m, natV6, 0, visit)
}

// PeerV4 is the key of the other direction of a pair. Egress: pod → remote
// translated to SNAT:port, so the reply key is remote → SNAT:port. Ingress:
// remote → SNAT:port back to pod:port, so the egress key is pod → remote.
func PeerV4(k NATKeyV4, v NATValV4) NATKeyV4 {
	if k.Dir == DirEgress {
		return NATKeyV4{Src: k.Dst, Dst: v.Addr, Sport: k.Dport, Dport: v.Port, Proto: k.Proto, Dir: DirIngress}
	}
	return NATKeyV4{Src: v.Addr, Dst: k.Src, Sport: v.Port, Dport: k.Sport, Proto: k.Proto, Dir: DirEgress}
}

// PeerV6 is PeerV4 for IPv6.
func PeerV6(k NATKeyV6, v NATValV6) NATKeyV6 {
	if k.Dir == DirEgress {
		return NATKeyV6{Src: k.Dst, Dst: v.Addr, Sport: k.Dport, Dport: v.Port, Proto: k.Proto, Dir: DirIngress}
	}
	return NATKeyV6{Src: v.Addr, Dst: k.Src, Sport: v.Port, Dport: k.Sport, Proto: k.Proto, Dir: DirEgress}
}

// natFamily is what the listing's read needs of one family's entries.
type natFamily[K comparable, V any] struct {
	name string
	hash func(K) uint64
	// head is an entry's direction, flags and last packet, read without
	// decoding its addresses (every entry's is read).
	head func(*K, *V) (dir, flags uint8, lastSeen uint64)
	// handover is a reply entry's handover mark.
	handover func(*V) uint8
	peer     func(*K, *V) K
	// isEgress says whether a key is a pair's egress entry (dir 0).
	isEgress func(*K) bool
	// record is the entry decoded, for a listed one.
	record func(*K, *V) natRecord
}

var (
	natV4 = natFamily[NATKeyV4, NATValV4]{
		name: MapNATV4, hash: hashNATKeyV4,
		head:     func(k *NATKeyV4, v *NATValV4) (uint8, uint8, uint64) { return k.Dir, v.Flags, v.LastSeenNs },
		handover: func(v *NATValV4) uint8 { return v.Handover },
		peer:     func(k *NATKeyV4, v *NATValV4) NATKeyV4 { return PeerV4(*k, *v) },
		isEgress: func(k *NATKeyV4) bool { return k.Dir == DirEgress },
		record: func(k *NATKeyV4, v *NATValV4) natRecord {
			return natRecord{
				dir: k.Dir, proto: k.Proto, flags: v.Flags, created: v.CreatedNs, lastSeen: v.LastSeenNs,
				src: netip.AddrPortFrom(AddrFrom4(k.Src), HostPort(k.Sport)),
				dst: netip.AddrPortFrom(AddrFrom4(k.Dst), HostPort(k.Dport)),
				to:  netip.AddrPortFrom(AddrFrom4(v.Addr), HostPort(v.Port)),
			}
		},
	}
	natV6 = natFamily[NATKeyV6, NATValV6]{
		name: MapNATV6, hash: hashNATKeyV6,
		head:     func(k *NATKeyV6, v *NATValV6) (uint8, uint8, uint64) { return k.Dir, v.Flags, v.LastSeenNs },
		handover: func(v *NATValV6) uint8 { return v.Handover },
		peer:     func(k *NATKeyV6, v *NATValV6) NATKeyV6 { return PeerV6(*k, *v) },
		isEgress: func(k *NATKeyV6) bool { return k.Dir == DirEgress },
		record: func(k *NATKeyV6, v *NATValV6) natRecord {
			return natRecord{
				ipv6: true, dir: k.Dir, proto: k.Proto, flags: v.Flags, created: v.CreatedNs, lastSeen: v.LastSeenNs,
				src: netip.AddrPortFrom(netip.AddrFrom16(k.Src), HostPort(k.Sport)),
				dst: netip.AddrPortFrom(netip.AddrFrom16(k.Dst), HostPort(k.Dport)),
				to:  netip.AddrPortFrom(netip.AddrFrom16(v.Addr), HostPort(v.Port)),
			}
		},
	}
)

// natRecord is one listed entry, decoded.
type natRecord struct {
	ipv6              bool
	dir, proto, flags uint8
	created, lastSeen uint64
	src, dst, to      netip.AddrPort
}

// replyInfo is what a pair takes from its reply entry.
type replyInfo struct {
	flags, handover uint8
	lastSeen        uint64
}

// isReply says whether an entry is a pair's reply entry, listed with its
// pair rather than on its own.
func isReply(dir, flags uint8) bool { return dir == DirIngress && flags&NATFlagHost == 0 }

// pairOf is the listed record of entry r (an egress entry, an inbound
// record or a node flow hold), joined to its reply entry rep when it is an
// egress entry (found: whether there is one).
func pairOf(r natRecord, rep replyInfo, found bool) NATPair {
	p := NATPair{IPv6: r.ipv6, Proto: r.proto, Flags: r.flags, CreatedNs: r.created, LastSeenNs: r.lastSeen}
	switch r.dir {
	case DirEgress:
		p.Kind, p.Src, p.Dst, p.Translated = KindMasquerade, r.src, r.dst, r.to
		if found {
			p.Flags |= rep.flags
			p.LastSeenNs = max(p.LastSeenNs, rep.lastSeen)
			p.Conntrack = rep.handover == HandoverConntrack
		} else {
			p.ReplyMissing = true
		}
	case DirInbound:
		// Keyed by the source's reply tuple: the remote opened it.
		p.Kind, p.Src, p.Dst = KindInbound, r.dst, r.src
	default:
		// The reply tuple of a node flow (dir 1 with NATFlagHost): remote
		// → node.
		p.Kind, p.Src, p.Dst = KindHost, r.dst, r.src
	}
	p.State = StateOf(p.Proto, p.Flags)
	return p
}

// natListPartReplies is how many reply entries a partition of the
// listing's join holds on average: an index of them (64 KiB of IPv4
// slots at most half full) stays in the CPU's caches.
const natListPartReplies = 1024

// replyEntry is a reply entry as a partition holds it.
type replyEntry[K comparable] struct {
	key  K
	info replyInfo
}

// egressEntry is an egress entry as a partition holds it.
type egressEntry[K comparable, V any] struct {
	key K
	val V
}

// readNATPairs is ReadNATPairsV4 of family f; replies, when known (the
// datapath's count of reply entries), sizes the partitions at once.
//
// The pass lists inbound records and node flow holds as it reads them, and
// puts each reply entry and each egress entry into one of a number of
// partitions by the hash of the reply key (an egress entry's peer). The
// pairs are then joined partition by partition, each in an index small
// enough for the CPU's caches: one index of the whole map was a table of
// tens of megabytes whose every access missed them (half the listing's
// CPU at 1 000 000 pairs). Memory is a copy of what a pair needs of its
// two entries, about 80 bytes a pair (IPv4).
func readNATPairs[K comparable, V any](m *ebpf.Map, f natFamily[K, V], replies int, visit func(*NATPair) bool) error {
	parts := 256 // unknown size
	if replies > 0 {
		parts = 1
		for parts < 65536 && parts*natListPartReplies < replies {
			parts *= 2
		}
	}
	shift := uint(64 - bits.TrailingZeros(uint(parts)))
	part := func(h uint64) uint64 {
		if shift == 64 {
			return 0
		}
		return h >> shift
	}
	var (
		replyParts  = make([][]replyEntry[K], parts)
		egressParts = make([][]egressEntry[K, V], parts)
		p           NATPair
		stopped     bool
	)
	if replies > 0 {
		// A fifth over the mean: the partitions' sizes spread around it.
		per := replies/parts + replies/parts/5 + 16
		for i := range parts {
			replyParts[i] = make([]replyEntry[K], 0, per)
			egressParts[i] = make([]egressEntry[K, V], 0, per)
		}
	}
	err := readChunks(m, f.name, natListChunk, func(keys []K, vals []V) bool {
		for i := range keys {
			k, v := &keys[i], &vals[i]
			dir, flags, lastSeen := f.head(k, v)
			switch {
			case isReply(dir, flags):
				j := part(f.hash(*k))
				replyParts[j] = append(replyParts[j], replyEntry[K]{*k, replyInfo{flags: flags, handover: f.handover(v), lastSeen: lastSeen}})
				continue
			case dir == DirEgress:
				j := part(f.hash(f.peer(k, v)))
				egressParts[j] = append(egressParts[j], egressEntry[K, V]{*k, *v})
				continue
			case dir == DirInbound || dir == DirIngress:
				p = pairOf(f.record(k, v), replyInfo{}, false)
			default:
				continue // no known direction
			}
			if stopped = !visit(&p); stopped {
				return false
			}
		}
		return true
	})
	if err != nil || stopped {
		return err
	}
	index := newReplyIndex(2*natListPartReplies, f.hash)
	for j := range parts {
		index.reset(len(replyParts[j]))
		for _, r := range replyParts[j] {
			index.put(r.key, r.info)
		}
		for i := range egressParts[j] {
			e := &egressParts[j][i]
			rep, found := index.get(f.peer(&e.key, &e.val))
			// Not found: the reply entry is gone (or the egress entry came
			// during the pass, after its reply's place was read).
			p = pairOf(f.record(&e.key, &e.val), rep, found)
			if !visit(&p) {
				return nil
			}
		}
		replyParts[j], egressParts[j] = nil, nil // done: its memory may go
	}
	return nil
}

// readBatches calls fn for every entry of m, read in batches of
// natReadChunk (one syscall each), or entry by entry where the kernel has
// no batch reads, until fn returns false.
func readBatches[K comparable, V any](m *ebpf.Map, name string, fn func(K, V) bool) error {
	return readBatchesOf(m, name, natReadChunk, fn)
}

// readBatchesOf is readBatches with batches of chunk entries.
func readBatchesOf[K comparable, V any](m *ebpf.Map, name string, chunk int, fn func(K, V) bool) error {
	return readChunks(m, name, chunk, func(keys []K, vals []V) bool {
		for i := range keys {
			if !fn(keys[i], vals[i]) {
				return false
			}
		}
		return true
	})
}

// readChunks calls fn with every batch of up to chunk entries of m (one
// syscall each; where the kernel has no batch reads, read entry by entry
// into batches), until fn returns false.
func readChunks[K comparable, V any](m *ebpf.Map, name string, chunk int, fn func([]K, []V) bool) error {
	var (
		cursor ebpf.MapBatchCursor
		keys   = make([]K, chunk)
		vals   = make([]V, chunk)
	)
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			break
		}
		if n > 0 && !fn(keys[:n], vals[:n]) {
			return nil
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read %s: %w", name, err)
		}
	}
	n := 0
	it := m.Iterate()
	for it.Next(&keys[n], &vals[n]) {
		if n++; n == chunk {
			if !fn(keys, vals) {
				return nil
			}
			n = 0
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	if n > 0 {
		fn(keys[:n], vals[:n])
	}
	return nil
}

// LifetimesOf reads the lifetimes the programs apply from the config map.
func LifetimesOf(config *ebpf.Map) (Lifetimes, error) {
	var c Config
	if err := config.Lookup(uint32(0), &c); err != nil {
		return Lifetimes{}, fmt.Errorf("read datapath config: %w", err)
	}
	var a [numStates]time.Duration
	for s := range a {
		a[s] = time.Duration(c.TimeoutNs[s])
	}
	return Lifetimes{
		TCPSyn: a[StateTCPSyn], TCPEstablished: a[StateTCPEstablished], TCPClosing: a[StateTCPClosing],
		TCPReset: a[StateTCPReset], UDP: a[StateUDP], UDPStream: a[StateUDPStream], ICMP: a[StateICMP],
		Other: a[StateOther],
	}, nil
}

// NATStates lists every connection state, in enum order.
func NATStates() []NATState {
	out := make([]NATState, numStates)
	for s := range out {
		out[s] = NATState(s)
	}
	return out
}
