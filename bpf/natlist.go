package bpf

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
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
	// ReplyMissing: a masquerade pair whose reply entry is gone (evicted
	// from the LRU map); its next packet from the source restores it.
	ReplyMissing bool
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

// ReadNATPairsV4 reads nat_v4 in batches and calls visit for every pair,
// inbound record and node flow hold (in map order), until visit returns
// false. The map is read twice: the reply entries are indexed first, so a
// pair costs no lookup, and memory is that index, not a copy of the map.
func ReadNATPairsV4(m *ebpf.Map, visit func(*NATPair) bool) error {
	return readNATPairs(m, MapNATV4, func(k NATKeyV4, v NATValV4) natRecord[NATKeyV4] {
		return natRecord[NATKeyV4]{
			dir: k.Dir, proto: k.Proto, flags: v.Flags, created: v.CreatedNs, lastSeen: v.LastSeenNs,
			src:  netip.AddrPortFrom(AddrFrom4(k.Src), HostPort(k.Sport)),
			dst:  netip.AddrPortFrom(AddrFrom4(k.Dst), HostPort(k.Dport)),
			to:   netip.AddrPortFrom(AddrFrom4(v.Addr), HostPort(v.Port)),
			peer: PeerV4(k, v),
		}
	}, visit)
}

// ReadNATPairsV6 is ReadNATPairsV4 for nat_v6.
func ReadNATPairsV6(m *ebpf.Map, visit func(*NATPair) bool) error {
	return readNATPairs(m, MapNATV6, func(k NATKeyV6, v NATValV6) natRecord[NATKeyV6] {
		return natRecord[NATKeyV6]{
			ipv6: true, dir: k.Dir, proto: k.Proto, flags: v.Flags, created: v.CreatedNs, lastSeen: v.LastSeenNs,
			src:  netip.AddrPortFrom(netip.AddrFrom16(k.Src), HostPort(k.Sport)),
			dst:  netip.AddrPortFrom(netip.AddrFrom16(k.Dst), HostPort(k.Dport)),
			to:   netip.AddrPortFrom(netip.AddrFrom16(v.Addr), HostPort(v.Port)),
			peer: PeerV6(k, v),
		}
	}, visit)
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

// natRecord is one entry, decoded.
type natRecord[K comparable] struct {
	ipv6              bool
	dir, proto, flags uint8
	created, lastSeen uint64
	src, dst, to      netip.AddrPort
	peer              K
}

// replyInfo is what a pair takes from its reply entry.
type replyInfo struct {
	flags    uint8
	lastSeen uint64
}

func readNATPairs[K comparable, V any](m *ebpf.Map, name string, decode func(K, V) natRecord[K],
	visit func(*NATPair) bool) error {
	// Pass 1: the reply entries, by key, so each egress entry finds its
	// other half without a syscall. Only they are kept: memory is this
	// index and one batch, not a copy of the map.
	replies := map[K]replyInfo{}
	err := readBatches(m, name, func(k K, v V) bool {
		if r := decode(k, v); r.dir == DirIngress && r.flags&NATFlagHost == 0 {
			replies[k] = replyInfo{flags: r.flags, lastSeen: r.lastSeen}
		}
		return true
	})
	if err != nil {
		return err
	}
	// Pass 2: one record per egress entry, inbound record and host hold.
	// An entry added between the passes may miss its reply (listed as
	// evicted until the next read).
	var p NATPair
	return readBatches(m, name, func(k K, v V) bool {
		r := decode(k, v)
		p = NATPair{IPv6: r.ipv6, Proto: r.proto, Flags: r.flags, CreatedNs: r.created, LastSeenNs: r.lastSeen}
		switch {
		case r.dir == DirEgress:
			p.Kind, p.Src, p.Dst, p.Translated = KindMasquerade, r.src, r.dst, r.to
			if rep, ok := replies[r.peer]; ok {
				p.Flags |= rep.flags
				p.LastSeenNs = max(p.LastSeenNs, rep.lastSeen)
			} else {
				p.ReplyMissing = true
			}
		case r.dir == DirInbound:
			// Keyed by the source's reply tuple: the remote opened it.
			p.Kind, p.Src, p.Dst = KindInbound, r.dst, r.src
		case r.dir == DirIngress && r.flags&NATFlagHost != 0:
			// The reply tuple of a node flow: remote → node.
			p.Kind, p.Src, p.Dst = KindHost, r.dst, r.src
		default:
			return true // a reply entry, listed with its pair
		}
		p.State = StateOf(p.Proto, p.Flags)
		return visit(&p)
	})
}

// readBatches calls fn for every entry of m, read in batches of
// natReadChunk (one syscall each), or entry by entry where the kernel has
// no batch reads, until fn returns false.
func readBatches[K comparable, V any](m *ebpf.Map, name string, fn func(K, V) bool) error {
	var (
		cursor ebpf.MapBatchCursor
		keys   = make([]K, natReadChunk)
		vals   = make([]V, natReadChunk)
	)
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			break
		}
		for i := range n {
			if !fn(keys[i], vals[i]) {
				return nil
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read %s: %w", name, err)
		}
	}
	var (
		k K
		v V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if !fn(k, v) {
			return nil
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read %s: %w", name, err)
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
