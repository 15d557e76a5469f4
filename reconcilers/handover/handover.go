package handover

import (
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/tables"
)

// mover moves flows between conntrack and one loaded datapath. adopt is
// called from the event listener, handBackAll and close from the job; mu
// guards the counts.
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

	back *handBackSender // the job's own
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

// failed counts a flow not moved; m.mu is held.
func (m *mover) failed(err error) {
	m.stats.Failed++
	m.stats.LastError = err.Error()
	m.log.Warn("Flow handover failed", "error", err)
}

// handBackAll hands every translated TCP and UDP pair not yet conntrack's
// to conntrack, and returns how many it handed back.
func (m *mover) handBackAll() (int, error) {
	if m.back == nil {
		s, err := dialHandBack()
		if err != nil {
			return 0, err
		}
		m.back = s
	}
	now := bpf.KtimeNow()
	flows, err := unmarked(m.dp.Maps.NatV4, bpf.ReadNATPairsV4, now)
	if err != nil {
		return 0, err
	}
	flows6, err := unmarked(m.dp.Maps.NatV6, bpf.ReadNATPairsV6, now)
	if err != nil {
		return 0, err
	}
	n, noted := 0, 0
	// The notes of the flows handed back (bpf.Datapath.NoteHandBackV4)
	// go in batches, each a moment after its last flow, when no segment
	// conntrack translated before that flow's entry was made can still
	// be on its way to the egress program.
	defer m.clearNotes(&noted)
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
		if f.proto == unix.IPPROTO_TCP {
			if noted == handBackNotes {
				m.clearNotes(&noted)
			}
			if err := m.noteHandBack(f); err != nil {
				return n, err
			}
			noted++
		}
		err := m.back.handBack(f)
		m.mu.Lock()
		if err != nil {
			m.failed(err)
		} else {
			m.stats.HandedBack++
			n++
		}
		m.mu.Unlock()
	}
	return n, nil
}

// handBackNotes is how many hand-back notes a pass keeps at a time (the
// maps hold 64).
const handBackNotes = 32

// handBackNoteGrace is how long a note stays after its flow's entry was
// made: longer than a segment takes from conntrack's confirmation to the
// egress program.
const handBackNoteGrace = 5 * time.Millisecond

// noteHandBack names f to the egress program while it is handed back.
func (m *mover) noteHandBack(f flow) error {
	if f.src.Addr().Is4() {
		return m.dp.NoteHandBackV4(keyV4(f), f.to.Port())
	}
	return m.dp.NoteHandBackV6(keyV6(f), f.to.Port())
}

// clearNotes removes the hand-back notes, if any, a grace after the last.
func (m *mover) clearNotes(noted *int) {
	if *noted == 0 {
		return
	}
	time.Sleep(handBackNoteGrace)
	if err := m.dp.ClearHandBacks(); err != nil {
		m.mu.Lock()
		m.failed(err)
		m.mu.Unlock()
	}
	*noted = 0
}

func (m *mover) close() {
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

// awaitAnswer is how long a UDP pair that has no answer yet is left out of
// the hand-back: its answer, coming while conntrack has no entry of the
// flow (between the hand-back's delete and create), would make conntrack
// an entry of its own whose port clashes with the agent's entry, and be
// lost (lib/handover.h, "The hand-back's races"). A query is answered
// well within it; a pair still unanswered after it is handed back anyway
// (the next pass, a second later).
const awaitAnswer = time.Second

// unmarked lists the translated pairs of m (nat_v4 or nat_v6: read is
// bpf.ReadNATPairsV4 or V6) that may be handed back and are not yet
// conntrack's, at now (bpf.KtimeNow).
func unmarked(m *ebpf.Map, read func(*ebpf.Map, func(*bpf.NATPair) bool) error, now uint64) ([]flow, error) {
	var out []flow
	err := read(m, func(p *bpf.NATPair) bool {
		if handBackNow(p, now) {
			out = append(out, flow{proto: p.Proto, src: p.Src, dst: p.Dst, to: p.Translated, seen: p.Flags&bpf.NATFlagSeen != 0})
		}
		return true
	})
	return out, err
}

// handBackNow says whether p is handed back by a pass at now: a whole
// masquerade pair not yet conntrack's that may go to it, and for UDP, one
// answered or past awaitAnswer.
func handBackNow(p *bpf.NATPair, now uint64) bool {
	if p.Kind != bpf.KindMasquerade || p.ReplyMissing || p.Conntrack || !handBackable(p.Proto, p.Flags) {
		return false
	}
	return p.Proto != unix.IPPROTO_UDP || p.Flags&bpf.NATFlagSeen != 0 || p.Age(now) >= awaitAnswer
}
