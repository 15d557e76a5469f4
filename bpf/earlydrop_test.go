package bpf

import (
	"flag"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// Early drop's candidates, its one walker, and the claims it shares with
// the other parties (lib/evict.h, lib/pressure.h, lib/flow.h).

// testObject runs the tests of this file on another build of masq.c (e.g.
// main's, to see them fail there): go test -run 'TestEarlyDrop|...'
// -bpf.testobject /tmp/main.o ./bpf/
var testObject = flag.String("bpf.testobject", "", "another masq_bpfel.o the early-drop tests run on instead of the embedded one")

func dropEnv(t *testing.T, o envOptions) *testEnv {
	t.Helper()
	o.object = *testObject
	return newEnv(t, o)
}

// establishedPairs makes n TCP pairs from pod1 (source ports from sport),
// each SYN answered by the remote, and returns them with their NAT ports.
func establishedPairs(t *testing.T, e *testEnv, sport uint16, n int) ([]flow, []uint16) {
	t.Helper()
	var fs []flow
	var ports []uint16
	for i := range n {
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: sport + uint16(i), dport: 443, tcpFlags: tcpSYN}
		port := masqueraded(t, e.egress(f.packet()), f, snat4)
		r := reply(f, snat4, port)
		r.tcpFlags = tcpSYN | tcpACK
		e.ingress(r.packet())
		fs, ports = append(fs, f), append(ports, port)
	}
	return fs, ports
}

// TestFullTableAdmitsOnceOneMayGo: a table full of established pairs
// refuses a new flow; the moment the remote closes one, the next new flow
// drops it and is admitted. The search used to be skipped for 100 ms
// after it found nothing (a walk of the whole map was too costly to
// repeat), so this flow was refused too.
func TestFullTableAdmitsOnceOneMayGo(t *testing.T) {
	const natMax = 16 // 8 pairs
	e := dropEnv(t, envOptions{natMax: natMax})
	est, ports := establishedPairs(t, e, 40000, natMax/2)
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 50000, dport: 443, tcpFlags: tcpSYN}
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
		t.Fatalf("new flow with the table full of established pairs: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNATFull: 1})

	r := reply(est[3], snat4, ports[3])
	r.tcpFlags = tcpFIN | tcpACK
	e.ingress(r.packet())
	f.sport++
	before = e.counters()
	if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActUnspec {
		t.Fatalf("new flow right after the remote closed a pair: verdict %d, want it admitted", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATEarlyDrop: 1})
}

// TestEarlyDropOneWalker: while another CPU searches (nat_drop's walker
// stamp is fresh), a new flow waits a few microseconds and is refused
// rather than searching the same candidates; a walker stamp older than
// 1 ms (a preempted search) is taken over, and released afterwards.
func TestEarlyDropOneWalker(t *testing.T) {
	const natMax = 32 // 16 pairs
	e := dropEnv(t, envOptions{natMax: natMax})
	if e.dp.Maps.NatDrop == nil {
		t.Fatal("this build has no nat_drop map: early drop has no walker lock")
	}
	udpQueries(t, e, 30000, natMax/2, false)
	setWalker := func(stamp uint64) {
		t.Helper()
		var s NATDropState
		if err := e.dp.Maps.NatDrop.Lookup(uint32(0), &s); err != nil {
			t.Fatal(err)
		}
		s.Walker = stamp
		if err := e.dp.Maps.NatDrop.Put(uint32(0), s); err != nil {
			t.Fatal(err)
		}
	}
	f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 50000, dport: 53, payload: []byte("q")}
	for range 3 {
		// Stamped ahead: a loaded machine may delay the run past the
		// 1 ms after which a walker counts as preempted.
		setWalker(monoNow() + uint64(time.Second))
		before := e.counters()
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
			t.Fatalf("new flow while another CPU searches: verdict %d, want TC_ACT_SHOT", int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterNATFull: 1})
	}
	setWalker(monoNow() - uint64(2*time.Millisecond))
	before := e.counters()
	masqueraded(t, e.egress(f.packet()), f, snat4)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATEarlyDrop: 1})
	var s NATDropState
	if err := e.dp.Maps.NatDrop.Lookup(uint32(0), &s); err != nil {
		t.Fatal(err)
	}
	if s.Walker != 0 {
		t.Fatalf("walker stamp %d left after the search", s.Walker)
	}
}

// TestEarlyDropTakesTheOldestNoted: the search looks at the oldest
// candidates noted (lib/evict.h): in a full table of 256 unanswered
// queries made one after the other, each of 8 new flows drops one of the
// first 16 made, never a later one (the map walk took the first 16 it met
// in bucket order, anywhere in the table).
func TestEarlyDropTakesTheOldestNoted(t *testing.T) {
	const natMax = 512 // 256 pairs
	e := dropEnv(t, envOptions{natMax: natMax})
	fs, ports := udpQueries(t, e, 30000, natMax/2, false)
	for i := range 8 {
		f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: uint16(50000 + i), dport: 53, payload: []byte("q")}
		before := e.counters()
		masqueraded(t, e.egress(f.packet()), f, snat4)
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATEarlyDrop: 1})
	}
	for i := 16; i < len(fs); i++ {
		if !stillPaired(t, e, fs[i], ports[i]) {
			t.Errorf("query %d (made after the first 16) was dropped", i)
		}
	}
}

// TestInboundRecordsEvictable: inbound flow records not answered by the
// pod are dropped for a new flow as conntrack's unassured entries are (a
// table full of them refused every new masqueraded flow), while an
// inbound TCP connection the pod accepted is kept.
func TestInboundRecordsEvictable(t *testing.T) {
	const natMax = 16
	e := dropEnv(t, envOptions{natMax: natMax})
	accepted := flow{src: remote4, dst: pod1, proto: protoTCP, sport: 5000, dport: 8080, tcpFlags: tcpSYN}
	e.ingress(accepted.packet())
	synAck := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 8080, dport: 5000, tcpFlags: tcpSYN | tcpACK}
	unchanged(t, synAck.packet(), e.egress(synAck.packet()))
	for i := range natMax - 1 {
		probe := flow{src: remote4, dst: pod1, proto: protoUDP, sport: uint16(6000 + i), dport: 7000, payload: []byte("p")}
		e.ingress(probe.packet())
	}
	if n := e.natCount(false); n[DirInbound] != natMax {
		t.Fatalf("entries by direction %v, want %d inbound records", n, natMax)
	}
	for i := range 6 {
		f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: uint16(50000 + i), dport: 53, payload: []byte("q")}
		before := e.counters()
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActUnspec {
			t.Fatalf("new flow %d with the table full of unanswered inbound records: verdict %d\n%v", i, int32(ret), e.counters())
		}
		if got := e.counters()[CounterNATEarlyDrop] - before[CounterNATEarlyDrop]; got == 0 {
			t.Fatalf("new flow %d admitted without an early drop", i)
		}
	}
	// The accepted connection's record is there: the pod's segments pass
	// from its own address.
	ack := synAck
	ack.tcpFlags = tcpACK
	before := e.counters()
	unchanged(t, ack.packet(), e.egress(ack.packet()))
	e.checkCounters(before, map[Counter]uint64{CounterSkipInboundReply: 1})
}

// TestNoInboundRecordForOwnFlowAnswer: the answer to a pod's own query to
// a non-masquerade destination (a resolver pod on another node of a
// directly routed network) reaches the pod and leaves no inbound record:
// such answers filled the table.
func TestNoInboundRecordForOwnFlowAnswer(t *testing.T) {
	e := dropEnv(t, envOptions{})
	q := flow{src: pod1, dst: netip.MustParseAddr("192.168.1.1"), proto: protoUDP, sport: 40000, dport: 53, payload: []byte("q")}
	unchanged(t, q.packet(), e.egress(q.packet()))
	a := flow{src: q.dst, dst: pod1, proto: protoUDP, sport: 53, dport: 40000, payload: []byte("a")}
	before := e.counters()
	unchanged(t, a.packet(), e.ingress(a.packet()))
	e.checkCounters(before, map[Counter]uint64{})
	if n := e.natCount(false); n[DirInbound] != 0 {
		t.Fatalf("entries by direction %v: an inbound record for an answer", n)
	}
	// A datagram that answers nothing the pod sent is still recorded.
	probe := a
	probe.sport = 5353
	before = e.counters()
	e.ingress(probe.packet())
	e.checkCounters(before, map[Counter]uint64{CounterInboundNew: 1})
}

// TestInboundReopenKeepsClaim: a SYN that reopens a closed inbound record
// which another party has claimed (the collector or early drop, between
// their claim and their delete) is dropped, and the claim stays: it
// used to restamp the record over the claim, so that a second party could
// claim it again.
func TestInboundReopenKeepsClaim(t *testing.T) {
	e := dropEnv(t, envOptions{})
	syn := flow{src: remote4, dst: pod1, proto: protoTCP, sport: 5000, dport: 8080, tcpFlags: tcpSYN}
	e.ingress(syn.packet())
	rk := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(8080), Dport: Port(5000), Proto: protoTCP, Dir: DirInbound}
	var v NATValV4
	if err := e.dp.Maps.NatV4.Lookup(rk, &v); err != nil {
		t.Fatalf("inbound record: %v", err)
	}
	v.Flags |= NATFlagFIN | NATFlagSeen
	v.LastSeenNs = natClaimed
	if err := e.dp.Maps.NatV4.Put(rk, v); err != nil {
		t.Fatal(err)
	}
	before := e.counters()
	if ret, _ := e.run(e.dp.Ingress, syn.packet()); ret != tcActShot {
		t.Fatalf("SYN on a claimed record: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterDropPairClaimed: 1})
	// Its drop reason is its own (it was "other").
	devs, err := ReadDevCounters(e.dp.Maps.DevCounters)
	if err != nil {
		t.Fatal(err)
	}
	var claimed, other uint64
	for _, d := range devs {
		claimed += d.Drops[DropPairClaimed]
		other += d.Drops[DropOther]
	}
	if claimed != 1 || other != 0 {
		t.Errorf("drop reasons: pair-claimed %d, other %d; want 1 and 0", claimed, other)
	}
	if err := e.dp.Maps.NatV4.Lookup(rk, &v); err != nil {
		t.Fatal(err)
	}
	if v.LastSeenNs != natClaimed {
		t.Fatalf("the record's claim was written over: stamp %d", v.LastSeenNs)
	}
}

// natClaimed is lib/flow.h's NAT_CLAIMED.
const natClaimed = 0x7fffffffffffffff

// TestEarlyDropSparesAnsweredRace races, through BPF_PROG_TEST_RUN from
// goroutines on every CPU, new flows that each need an early drop (a full
// table of 16 384 entries, nearly all established pairs written by the
// test) against the answers (SYN-ACKs) of the 32 unanswered pairs made in
// each round (the only pairs that may go; each round starts from the
// filler alone). A pair whose answer was translated is established: it must
// never be dropped. Early drop judged a pair and then claimed it with a
// fresh stamp, after a walk of most of the map: a pair answered during the
// walk went.
func TestEarlyDropSparesAnsweredRace(t *testing.T) {
	const natMax = 1 << 14
	const fresh = 32
	e := dropEnv(t, envOptions{natMax: natMax, portMin: 1024, portMax: 65535})
	fillEstablished(t, e, natMax/2-fresh)
	workers := max(runtime.GOMAXPROCS(0), 2)
	var lost []string
	for round := range 12 {
		clearRound(t, e)
		fs := make([]flow, fresh)
		ports := make([]uint16, fresh)
		for i := range fresh {
			fs[i] = flow{src: pod2, dst: remote4, proto: protoTCP, sport: uint16(1024 + round*fresh + i), dport: 443, tcpFlags: tcpSYN}
			// A search reads a bounded number of the ring's slots: a
			// refused SYN is sent again, as a client does.
			ret, out := e.run(e.dp.Egress, fs[i].packet())
			for try := 0; ret != tcActUnspec && try < 100; try++ {
				ret, out = e.run(e.dp.Egress, fs[i].packet())
			}
			if ret != tcActUnspec {
				var st NATDropState
				e.dp.Maps.NatDrop.Lookup(uint32(0), &st)
				t.Fatalf("round %d: SYN %d refused 100 times (ring head %d tail %d)\n%v\n%v", round, i, st.Head, st.Tail, e.counters(), e.natCount(false))
			}
			ports[i] = parse(t, out).sport
		}
		var (
			wg       sync.WaitGroup
			answered [fresh]atomic.Bool
			done     atomic.Bool
		)
		// One answerer and a dropper on every other CPU, all at once
		// (more goroutines than CPUs ran one after the other).
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				out := make([]byte, 256)
				if w > 0 { // new flows, each needing an early drop
					for n := 0; !done.Load(); n++ {
						f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: uint16(1024 + (w*20000+n)%60000), dport: uint16(1000 + round), payload: []byte("q")}
						e.dp.Egress.Run(&ebpf.RunOptions{Data: f.packet(), DataOut: out, Context: skbContext{Ifindex: loIfindex}})
					}
					return
				}
				defer done.Store(true)
				// The answers spread over the droppers' searches.
				for i := range fresh {
					for until := time.Now().Add(20 * time.Microsecond); time.Now().Before(until); {
					}
					r := reply(fs[i], snat4, ports[i])
					r.tcpFlags = tcpSYN | tcpACK
					opts := &ebpf.RunOptions{Data: r.packet(), DataOut: out, Context: skbContext{Ifindex: loIfindex}}
					if ret, err := e.dp.Ingress.Run(opts); err == nil && ret == tcActUnspec {
						if p, ok := parseOK(opts.DataOut); ok && p.dst == pod2 {
							answered[i].Store(true)
						}
					}
				}
			}()
		}
		wg.Wait()
		if testing.Verbose() {
			c := e.counters()
			n := 0
			for i := range fresh {
				if answered[i].Load() {
					n++
				}
			}
			t.Logf("round %d: %d answered; so far %d early drops, %d refused", round, n, c[CounterNATEarlyDrop], c[CounterNATFull])
		}
		for i := range fresh {
			if !answered[i].Load() {
				continue
			}
			rk := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(ports[i]), Proto: protoTCP, Dir: DirIngress}
			var v NATValV4
			if err := e.dp.Maps.NatV4.Lookup(rk, &v); err != nil {
				lost = append(lost, fmt.Sprintf("%v:%d (port %d)", fs[i].src, fs[i].sport, ports[i]))
			}
		}
	}
	c := e.counters()
	t.Logf("%d early drops, %d refused", c[CounterNATEarlyDrop], c[CounterNATFull])
	if c[CounterNATEarlyDrop] == 0 {
		t.Fatal("no early drop: the test raced nothing")
	}
	if bad := brokenPairs(e.dp.Maps.NatV4, PeerV4, func(k NATKeyV4) string { return fmt.Sprintf("%+v", k) }); len(bad) > 0 {
		t.Errorf("%d broken pairs, e.g. %v", len(bad), bad[:min(len(bad), 5)])
	}
	if len(lost) > 0 {
		t.Fatalf("%d answered pairs dropped by early drop, e.g. %v", len(lost), lost[:min(len(lost), 5)])
	}
}

// clearRound deletes the pairs of the race's previous round (everything
// to or from remote4), so that the next round's SYNs fit.
func clearRound(t *testing.T, e *testEnv) {
	t.Helper()
	var (
		k    NATKeyV4
		v    NATValV4
		keys []NATKeyV4
	)
	it := e.dp.Maps.NatV4.Iterate()
	for it.Next(&k, &v) {
		if AddrFrom4(k.Src) == remote4 || AddrFrom4(k.Dst) == remote4 {
			keys = append(keys, k)
		}
	}
	for _, k := range keys {
		e.dp.Maps.NatV4.Delete(k)
	}
}

// fillEstablished writes n established TCP pairs (the remote's answer
// seen) from 10.0.3.0/24 into nat_v4, as the programs would have made
// them, stamped now.
func fillEstablished(tb testing.TB, e *testEnv, n int) {
	tb.Helper()
	keys := make([]NATKeyV4, 0, 2*n)
	vals := make([]NATValV4, 0, 2*n)
	now := monoNow()
	for i := range n {
		src := netip.AddrFrom4([4]byte{10, 0, 3, byte(i / 60000)})
		sport, natPort := uint16(1024+i%60000), uint16(1024+i%60000)
		dst := netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
		out := NATKeyV4{Src: Addr4(src), Dst: Addr4(dst), Sport: Port(sport), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
		in := NATKeyV4{Src: Addr4(dst), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(natPort), Proto: protoTCP, Dir: DirIngress}
		keys = append(keys, out, in)
		vals = append(vals, NATValV4{Addr: Addr4(snat4), Port: Port(natPort), LastSeenNs: now, CreatedNs: now},
			NATValV4{Addr: Addr4(src), Port: Port(sport), Flags: NATFlagSeen, LastSeenNs: now, CreatedNs: now})
	}
	for i := 0; i < len(keys); i += 8192 {
		j := min(i+8192, len(keys))
		if _, err := e.dp.Maps.NatV4.BatchUpdate(keys[i:j], vals[i:j], nil); err != nil {
			tb.Fatalf("fill: %v", err)
		}
	}
}

// TestReplyNeverReachesAnotherPod races replies of many flows, each
// checked to reach its own pod or no pod at all, against a
// collector ending pairs whose lifetimes are 20 µs and new flows taking
// their entries (the preallocated map reuses a deleted element at once): a
// reply whose entry was deleted and reused between the lookup and the read
// of its value went to the new entry's pod.
func TestReplyNeverReachesAnotherPod(t *testing.T) {
	e := dropEnv(t, envOptions{natMax: 1 << 12, portMin: 61000, portMax: 61003})
	l := DefaultLifetimes
	l.UDP = 20 * time.Microsecond
	if err := e.dp.SetLifetimes(l); err != nil {
		t.Fatal(err)
	}
	workers := max(runtime.GOMAXPROCS(0), 2)
	var (
		wg, gc sync.WaitGroup
		stop   atomic.Bool
		wrong  atomic.Int64
		good   atomic.Int64
		sample atomic.Value
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			// Each worker its own pod and its own remote: a reply key is
			// only ever one worker's, so a reply that reaches another
			// pod was translated with another key's value.
			src := netip.AddrFrom4([4]byte{10, 0, 4, byte(w) + 1})
			remote := netip.AddrFrom4([4]byte{8, 8, 4, byte(w) + 1})
			out := make([]byte, 256)
			for i := range 6000 {
				f := flow{src: src, dst: remote, proto: protoUDP, sport: uint16(20000 + i%8), dport: 53, payload: []byte("q")}
				opts := &ebpf.RunOptions{Data: f.packet(), DataOut: out, Context: skbContext{Ifindex: loIfindex}}
				if ret, err := e.dp.Egress.Run(opts); err != nil || ret != tcActUnspec {
					continue
				}
				p, ok := parseOK(opts.DataOut)
				if !ok {
					continue
				}
				r := reply(f, snat4, p.sport)
				ropts := &ebpf.RunOptions{Data: r.packet(), DataOut: out, Context: skbContext{Ifindex: loIfindex}}
				if ret, err := e.dp.Ingress.Run(ropts); err != nil || ret != tcActUnspec {
					continue
				}
				rp, ok := parseOK(ropts.DataOut)
				if !ok || rp.dst == snat4 {
					continue // untranslated: its pair had gone
				}
				if rp.dst != src {
					wrong.Add(1)
					sample.Store(rp.dst.String())
					continue
				}
				good.Add(1)
			}
		}()
	}
	gc.Add(1)
	go func() {
		defer gc.Done()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var k NATKeyV4
		var v NATValV4
		for !stop.Load() {
			var keys []NATKeyV4
			it := e.dp.Maps.NatV4.Iterate()
			for it.Next(&k, &v) {
				if k.Dir == DirIngress {
					keys = append(keys, k)
				}
			}
			for _, k := range keys {
				e.dp.EndPairV4(k, false)
			}
		}
	}()
	wg.Wait()
	stop.Store(true)
	gc.Wait()
	t.Logf("%d replies to their own pod", good.Load())
	if n := wrong.Load(); n > 0 {
		t.Fatalf("%d replies went to another pod (e.g. %v)", n, sample.Load())
	}
	if good.Load() == 0 {
		t.Fatal("no reply translated: the test raced nothing")
	}
}

// parseOK reads the addresses and ports of an IPv4 TCP or UDP frame the
// programs returned, without a testing.T (for goroutines).
func parseOK(frame []byte) (p parsed, ok bool) {
	if len(frame) < 14+20 || frame[14]>>4 != 4 {
		return parsed{}, false
	}
	ip := frame[14:]
	hl := int(ip[0]&0x0f) * 4
	if len(ip) < hl+4 {
		return parsed{}, false
	}
	p.src = netip.AddrFrom4([4]byte(ip[12:16]))
	p.dst = netip.AddrFrom4([4]byte(ip[16:20]))
	p.sport = uint16(ip[hl])<<8 | uint16(ip[hl+1])
	p.dport = uint16(ip[hl+2])<<8 | uint16(ip[hl+3])
	return p, true
}
