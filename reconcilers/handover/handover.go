package handover

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/tables"
)

// mover moves flows between conntrack and one loaded datapath. Its methods
// are safe for concurrent use.
type mover struct {
	log *slog.Logger
	dp  *bpf.Datapath
	// forwarded says whether a source address is one the datapath
	// masquerades for (not one of the node's own addresses).
	forwarded func(netip.Addr) bool
	// nodeAddr says whether an address is the node's (a MASQUERADE
	// translation).
	nodeAddr func(netip.Addr) bool

	mu    sync.Mutex
	stats tables.Handover // the counts only
	back  *handBackSender
}

// adopt makes f's NAT pair, if f is a masquerade binding of a forwarded
// source to one of the node's addresses.
func (m *mover) adopt(f conntrack.Flow) {
	b, ok := bindingOf(f)
	if !ok || !m.forwarded(b.src.Addr()) || !m.nodeAddr(b.to.Addr()) {
		return
	}
	var (
		res bpf.HandoverResult
		err error
	)
	if b.src.Addr().Is4() {
		res, err = m.dp.AdoptV4(keyV4(b), b.to.Addr(), b.to.Port(), b.seen)
	} else {
		res, err = m.dp.AdoptV6(keyV6(b), b.to.Addr(), b.to.Port(), b.seen)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case err != nil:
		m.failed(fmt.Errorf("adopt %v: %w", b, err))
	case res == bpf.HandoverDone:
		m.stats.Adopted++
	case res == bpf.HandoverExists:
		// the datapath translates it already (or adopted it before)
	default:
		m.failed(fmt.Errorf("adopt %v: %v", b, res))
	}
}

func (m *mover) failed(err error) {
	m.stats.Failed++
	m.stats.LastError = err.Error()
	m.log.Warn("Flow handover failed", "error", err)
}

// handBackAll hands every translated TCP and UDP pair not yet conntrack's
// to conntrack, and returns how many it handed back.
func (m *mover) handBackAll() (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.back == nil {
		s, err := dialHandBack()
		if err != nil {
			return 0, err
		}
		m.back = s
	}
	flows, err := unmarkedV4(m.dp.Maps.NatV4)
	if err != nil {
		return 0, err
	}
	flows6, err := unmarkedV6(m.dp.Maps.NatV6)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, f := range append(flows, flows6...) {
		// Marked first: from the mark on, the ingress program asks
		// conntrack, which has no translating entry yet and so leaves
		// the replies to the pair until the entry exists.
		var res bpf.HandoverResult
		if f.src.Addr().Is4() {
			res, err = m.dp.MarkConntrackV4(keyV4(f))
		} else {
			res, err = m.dp.MarkConntrackV6(keyV6(f))
		}
		if err != nil {
			return n, err
		}
		if res != bpf.HandoverDone {
			continue // ended meanwhile
		}
		if err := m.back.handBack(f); err != nil {
			m.failed(err)
			continue
		}
		m.stats.HandedBack++
		n++
	}
	return n, nil
}

func (m *mover) close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.back != nil {
		m.back.Close()
		m.back = nil
	}
}

func keyV4(f flow) bpf.NATKeyV4 {
	return bpf.NATKeyV4{Src: bpf.Addr4(f.src.Addr()), Dst: bpf.Addr4(f.dst.Addr()),
		Sport: bpf.Port(f.src.Port()), Dport: bpf.Port(f.dst.Port()), Proto: f.proto, Dir: bpf.DirEgress}
}

func keyV6(f flow) bpf.NATKeyV6 {
	return bpf.NATKeyV6{Src: f.src.Addr().As16(), Dst: f.dst.Addr().As16(),
		Sport: bpf.Port(f.src.Port()), Dport: bpf.Port(f.dst.Port()), Proto: f.proto, Dir: bpf.DirEgress}
}

// handBackable says whether a pair with these protocol and flags may go
// to conntrack: a TCP or UDP flow that is not ending.
func handBackable(proto, flags uint8) bool {
	return (proto == unix.IPPROTO_TCP || proto == unix.IPPROTO_UDP) &&
		flags&(bpf.NATFlagFIN|bpf.NATFlagRST|bpf.NATFlagHost) == 0
}

// unmarkedV4 lists nat_v4's translated pairs that may be handed back and
// are not marked as conntrack's.
func unmarkedV4(m *ebpf.Map) ([]flow, error) {
	return unmarked(m, func(k bpf.NATKeyV4, v bpf.NATValV4) (entry[bpf.NATKeyV4], bool) {
		return entry[bpf.NATKeyV4]{dir: k.Dir, proto: k.Proto, flags: v.Flags, handover: v.Handover, peer: bpf.PeerV4(k, v),
			f: flow{proto: k.Proto,
				src: netip.AddrPortFrom(bpf.AddrFrom4(k.Src), bpf.HostPort(k.Sport)),
				dst: netip.AddrPortFrom(bpf.AddrFrom4(k.Dst), bpf.HostPort(k.Dport)),
				to:  netip.AddrPortFrom(bpf.AddrFrom4(v.Addr), bpf.HostPort(v.Port))}}, true
	})
}

// unmarkedV6 is unmarkedV4 for nat_v6.
func unmarkedV6(m *ebpf.Map) ([]flow, error) {
	return unmarked(m, func(k bpf.NATKeyV6, v bpf.NATValV6) (entry[bpf.NATKeyV6], bool) {
		return entry[bpf.NATKeyV6]{dir: k.Dir, proto: k.Proto, flags: v.Flags, handover: v.Handover, peer: bpf.PeerV6(k, v),
			f: flow{proto: k.Proto,
				src: netip.AddrPortFrom(netip.AddrFrom16(k.Src), bpf.HostPort(k.Sport)),
				dst: netip.AddrPortFrom(netip.AddrFrom16(k.Dst), bpf.HostPort(k.Dport)),
				to:  netip.AddrPortFrom(netip.AddrFrom16(v.Addr), bpf.HostPort(v.Port))}}, true
	})
}

type entry[K comparable] struct {
	dir, proto, flags, handover uint8
	peer                        K
	f                           flow
}

// unmarked reads the map twice: the reply entries first (their flags and
// mark), then the egress entries, each joined with its reply.
func unmarked[K comparable, V any](m *ebpf.Map, decode func(K, V) (entry[K], bool)) ([]flow, error) {
	type reply struct {
		flags    uint8
		marked   bool
		pointsTo netip.AddrPort
	}
	replies := map[K]reply{}
	var (
		k K
		v V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if e, _ := decode(k, v); e.dir == bpf.DirIngress {
			replies[k] = reply{flags: e.flags, marked: e.handover == bpf.HandoverConntrack, pointsTo: e.f.to}
		}
	}
	if err := it.Err(); err != nil && !errors.Is(err, ebpf.ErrIterationAborted) {
		return nil, fmt.Errorf("read %v: %w", m, err)
	}
	var out []flow
	it = m.Iterate()
	for it.Next(&k, &v) {
		e, _ := decode(k, v)
		if e.dir != bpf.DirEgress {
			continue
		}
		r, ok := replies[e.peer]
		if !ok || r.marked || r.pointsTo != e.f.src || !handBackable(e.proto, e.flags|r.flags) {
			continue
		}
		e.f.seen = r.flags&bpf.NATFlagSeen != 0
		out = append(out, e.f)
	}
	if err := it.Err(); err != nil && !errors.Is(err, ebpf.ErrIterationAborted) {
		return nil, fmt.Errorf("read %v: %w", m, err)
	}
	return out, nil
}
