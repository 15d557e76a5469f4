package bpf

import (
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// Early drop's notes follow their pair's droppability (lib/evict.h): the
// program that makes a pair assured arms its note, so that a search skips
// it without a lookup until the pair could have expired; one that makes it
// droppable again notes it again, unarmed; the collector clears the note
// of a pair it deletes.

// noteArmed is NAT_NOTE_ARMED of lib/evict.h: the bit of created_ns that
// marks an armed note (the rest is its entry's stamp when armed).
const noteArmed = uint64(1) << 63

// noteV4 returns the created_ns of the note of key k (0: none).
func (e *testEnv) noteV4(t testing.TB, k NATKeyV4) uint64 {
	t.Helper()
	return noteIn(t, e.dp.Maps.NatCandV4, k, func(c *NATCandV4) (NATKeyV4, uint64) { return c.Key, c.CreatedNs })
}

// noteIn returns the created_ns of the note of key k in notes map m (0:
// none); of reads a slot's key and created_ns.
func noteIn[K comparable, C any](t testing.TB, m *ebpf.Map, k K, of func(*C) (K, uint64)) uint64 {
	t.Helper()
	var (
		slot uint32
		c    C
	)
	it := m.Iterate()
	for it.Next(&slot, &c) {
		if key, created := of(&c); created != 0 && key == k {
			return created
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return 0
}

// wantNote checks that key k's note is as want says: "droppable" (a note
// a search looks up, of the entry made at created), "armed" (with a stamp
// no later than the entry's), or "none".
func (e *testEnv) wantNote(t *testing.T, what string, k NATKeyV4, want string) {
	t.Helper()
	var v NATValV4
	if err := e.dp.Maps.NatV4.Lookup(&k, &v); err != nil && want != "none" {
		t.Fatalf("%s: entry %+v: %v", what, k, err)
	}
	got := e.noteV4(t, k)
	switch {
	case want == "none" && got != 0:
		t.Fatalf("%s: note %#x, want none", what, got)
	case want == "droppable" && (got == 0 || got&noteArmed != 0 || got != v.CreatedNs):
		t.Fatalf("%s: note %#x, want an unarmed one of the entry made at %d", what, got, v.CreatedNs)
	case want == "armed" && (got&noteArmed == 0 || got&^noteArmed > v.LastSeenNs || got&^noteArmed == 0):
		t.Fatalf("%s: note %#x, want one armed with a stamp up to the entry's %d", what, got, v.LastSeenNs)
	}
}

// TestNoteArmedWhenAnswered: a pair noted when made (not answered yet)
// and then answered (assured) has its note armed by the answer: a search
// that meets it reads the slot and moves on, no lookup of the pair (every
// such note cost one, and a search at a busy node met mostly those). Its
// first FIN notes it again, unarmed. The same for an inbound record the
// pod answers, a UDP pair that becomes a stream (its answer alone keeps it
// droppable: an answered query), an SCTP association (its end notes it
// again); and the collector clears the note of a pair it ends.
func TestNoteArmedWhenAnswered(t *testing.T) {
	t.Run("tcp", func(t *testing.T) {
		e := dropEnv(t, envOptions{})
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
		port := masqueraded(t, e.egress(f.packet()), f, snat4)
		k := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(port), Proto: protoTCP, Dir: DirIngress}
		e.wantNote(t, "made", k, "droppable")
		e.ingress(reply(f, snat4, port).packet())
		e.wantNote(t, "answered", k, "armed")
		r := reply(f, snat4, port)
		r.tcpFlags = tcpFIN | tcpACK
		e.ingress(r.packet())
		e.wantNote(t, "the remote's FIN", k, "droppable")
		if _, err := e.dp.EndPairV4(k, true); err != nil {
			t.Fatal(err)
		}
		e.wantNote(t, "ended by the collector", k, "none")
	})
	t.Run("tcp6", func(t *testing.T) {
		e := dropEnv(t, envOptions{})
		f := flow{src: pod6, dst: remote6, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
		port := masqueraded(t, e.egress(f.packet()), f, snat6)
		k := NATKeyV6{Src: remote6.As16(), Dst: snat6.As16(), Sport: Port(443), Dport: Port(port), Proto: protoTCP, Dir: DirIngress}
		note := func() uint64 {
			return noteIn(t, e.dp.Maps.NatCandV6, k, func(c *masqNatV6Cand) (NATKeyV6, uint64) { return c.Key, c.CreatedNs })
		}
		if n := note(); n == 0 || n&noteArmed != 0 {
			t.Fatalf("made: note %#x, want an unarmed one", n)
		}
		e.ingress(reply(f, snat6, port).packet())
		if n := note(); n&noteArmed == 0 {
			t.Fatalf("answered: note %#x, want an armed one", n)
		}
	})
	t.Run("inbound", func(t *testing.T) {
		e := dropEnv(t, envOptions{})
		syn := flow{src: remote4, dst: pod1, proto: protoTCP, sport: 5000, dport: 8080, tcpFlags: tcpSYN}
		e.ingress(syn.packet())
		k := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(8080), Dport: Port(5000), Proto: protoTCP, Dir: DirInbound}
		e.wantNote(t, "made", k, "droppable")
		synAck := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 8080, dport: 5000, tcpFlags: tcpSYN | tcpACK}
		unchanged(t, synAck.packet(), e.egress(synAck.packet()))
		e.wantNote(t, "answered by the pod", k, "armed")
		fin := syn
		fin.tcpFlags = tcpFIN | tcpACK
		e.ingress(fin.packet())
		e.wantNote(t, "the remote's FIN", k, "droppable")
	})
	t.Run("udp", func(t *testing.T) {
		e := dropEnv(t, envOptions{})
		// Two pairs: one becomes a stream on its answer's packet
		// (ingress), the other on the pod's (egress).
		var keys [2]NATKeyV4
		var flows [2]flow
		var ports [2]uint16
		for i := range flows {
			flows[i] = flow{src: pod1, dst: remote4, proto: protoUDP, sport: uint16(40000 + i), dport: 53, payload: []byte("q")}
			ports[i] = masqueraded(t, e.egress(flows[i].packet()), flows[i], snat4)
			keys[i] = NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(53), Dport: Port(ports[i]), Proto: protoUDP, Dir: DirIngress}
			e.wantNote(t, "made", keys[i], "droppable")
			e.ingress(reply(flows[i], snat4, ports[i]).packet())
			e.wantNote(t, "answered (a query: droppable)", keys[i], "droppable")
		}
		time.Sleep(2100 * time.Millisecond) // NAT_STREAM_NS
		e.ingress(reply(flows[0], snat4, ports[0]).packet())
		e.wantNote(t, "a stream by its answer", keys[0], "armed")
		masqueraded(t, e.egress(flows[1].packet()), flows[1], snat4)
		e.wantNote(t, "a stream by the pod's packet", keys[1], "armed")
	})
	t.Run("sctp", func(t *testing.T) {
		e := dropEnv(t, envOptions{})
		e.egress(sctpChunkPacket(pod1, remote4, 5000, 38412, sctpCookieEcho))
		k := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(38412), Dport: Port(5000), Proto: protoSCTP, Dir: DirIngress}
		e.wantNote(t, "made", k, "droppable")
		e.ingress(sctpChunkPacket(remote4, snat4, 38412, 5000, sctpCookieAck))
		e.wantNote(t, "assured", k, "armed")
		e.egress(sctpChunkPacket(pod1, remote4, 5000, 38412, sctpShutdown))
		e.wantNote(t, "the pod's SHUTDOWN", k, "droppable")
		e.ingress(sctpChunkPacket(remote4, snat4, 38412, 5000, sctpCookieAck))
		e.wantNote(t, "assured again", k, "armed")
		e.ingress(sctpChunkPacket(remote4, snat4, 38412, 5000, sctpAbort))
		e.wantNote(t, "the remote's ABORT", k, "droppable")
	})
}

// TestFullTableAdmitsOnceAssociationEnds: an SCTP association assured (its
// note armed) that ends is noted again: the next new flow at a table
// whose other pairs are all assured drops it. Without the new note the
// search would skip its armed one until its lifetime passed.
func TestFullTableAdmitsOnceAssociationEnds(t *testing.T) {
	const natMax = 16 // 8 pairs
	e := dropEnv(t, envOptions{natMax: natMax})
	establishedPairs(t, e, 40000, natMax/2-1)
	e.egress(sctpChunkPacket(pod1, remote4, 5000, 38412, sctpCookieEcho))
	e.ingress(sctpChunkPacket(remote4, snat4, 38412, 5000, sctpCookieAck))
	f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 50000, dport: 53, payload: []byte("q")}
	if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
		t.Fatalf("new flow at a table of assured pairs: verdict %d, want refused", int32(ret))
	}
	e.egress(sctpChunkPacket(pod1, remote4, 5000, 38412, sctpShutdown))
	f.sport++
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActUnspec {
		t.Fatalf("new flow after the association's SHUTDOWN: verdict %d, want admitted\n%v", int32(ret), e.counters())
	}
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATEarlyDrop: 1})
}

// TestNoteSeedKeptAcrossLoads: an agent that starts again (a new load on
// the same pins) keeps the notes' seed, so the answer to a pair made
// before the restart finds its note and arms it. With a new seed the note
// would lie away from its key's new probes and stay unarmed: each search
// at a full table would look it up.
func TestNoteSeedKeptAcrossLoads(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	port := masqueraded(t, e.egress(f.packet()), f, snat4)
	k := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(port), Proto: protoTCP, Dir: DirIngress}
	e.wantNote(t, "made", k, "droppable")
	seed := func(d *Datapath) uint32 {
		var s uint32
		if err := d.coll.Variables["nat_note_seed"].Get(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := seed(e.dp)
	e.reload(t, LoadOptions{NonMasqMaxEntries: 100})
	if after := seed(e.dp); after != before {
		t.Fatalf("seed %#x after the restart, %#x before", after, before)
	}
	e.ingress(reply(f, snat4, port).packet())
	e.wantNote(t, "answered after the restart", k, "armed")
}
