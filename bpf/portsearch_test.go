package bpf

import (
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"
)

// The port search (lib/ports.h) and who closed first (lib/flow.h), through
// BPF_PROG_TEST_RUN.

// putPair4 inserts an answered TCP pair pod:sport -> dst:443 on NAT port
// nport, stamped now, as the programs would have made it.
func putPair4(t *testing.T, e *testEnv, pod, dst netip.Addr, sport, nport uint16, now uint64) {
	t.Helper()
	out := NATKeyV4{Src: Addr4(pod), Dst: Addr4(dst), Sport: Port(sport), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
	in := NATKeyV4{Src: Addr4(dst), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(nport), Proto: protoTCP, Dir: DirIngress}
	if err := e.dp.Maps.NatV4.Put(out, NATValV4{Addr: Addr4(snat4), Port: Port(nport), Flags: NATFlagSeen,
		LastSeenNs: now, CreatedNs: now}); err != nil {
		t.Fatal(err)
	}
	if err := e.dp.Maps.NatV4.Put(in, NATValV4{Addr: Addr4(pod), Port: Port(sport), Flags: NATFlagSeen,
		LastSeenNs: now, CreatedNs: now}); err != nil {
		t.Fatal(err)
	}
}

// TestSearchFindsLastFreePort: with every port of a 100-port range but one
// held by live pairs toward the server, a new connection to that server
// gets the one free port: the search walks 128 consecutive ports from a
// random offset, which covers a smaller space whole (Linux's
// nf_nat_l4proto_unique_tuple). The earlier search (8 hashed and 24 random
// probes) missed it about two times in three.
func TestSearchFindsLastFreePort(t *testing.T) {
	const min, max = 61000, 61099
	e := newEnv(t, envOptions{portMin: min, portMax: max, natMax: 4096})
	pod := netip.MustParseAddr("10.0.9.1")
	for trial := range 10 {
		free := uint16(min + rand.IntN(max-min+1))
		now := monoNow()
		for p := uint16(min); p <= max; p++ {
			if p != free {
				putPair4(t, e, pod, remote4, p, p, now)
			}
		}
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: uint16(40000 + trial), dport: 443, tcpFlags: tcpSYN}
		ret, out := e.run(e.dp.Egress, f.packet())
		if ret != tcActUnspec {
			t.Fatalf("trial %d: verdict %d with port %d free, want TC_ACT_UNSPEC", trial, int32(ret), free)
		}
		fromSNATPort(t, out, snat4, free)
		clearMap(t, e.dp.Maps.NatV4)
	}
}

// TestFullSpaceRefusedWithoutChange: when every port of the range is held
// toward the server by an answered pair and the table is full, a new
// connection is refused as no-port: each port is looked up, none taken
// over, no entry added or dropped (no early drop for a search that found
// nothing).
func TestFullSpaceRefusedWithoutChange(t *testing.T) {
	const min, max = 61000, 61031
	e := newEnv(t, envOptions{portMin: min, portMax: max, natMax: 64})
	pod := netip.MustParseAddr("10.0.9.1")
	now := monoNow()
	for p := uint16(min); p <= max; p++ {
		putPair4(t, e, pod, remote4, p, p, now)
	}
	count := func() int {
		n, err := CountEntries[NATKeyV4, NATValV4](e.dp.Maps.NatV4)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n != 64 {
		t.Fatalf("%d entries, want a full table of 64", n)
	}
	before := e.counters()
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
		t.Fatalf("verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})
	if n := count(); n != 64 {
		t.Fatalf("%d entries after the refused flow, want 64", n)
	}
}

// closeFlow runs a connection a (answered on NAT port nport of snat) to its
// close: the pod's FIN (seq 1000, with payload bytes of data), then the
// server's FIN acknowledging serverAck, then the pod's last ACK.
func closeFlow(t *testing.T, e *testEnv, a flow, snat netip.Addr, nport uint16, payload []byte, serverAck uint32) {
	t.Helper()
	a.tcpFlags = tcpSYN
	fromSNATPort(t, e.egress(a.packet()), snat, nport)
	r := reply(a, snat, nport)
	r.tcpFlags = tcpSYN | tcpACK
	e.ingress(r.packet())
	fin := a
	fin.tcpFlags, fin.seq, fin.payload = tcpFIN|tcpACK, 1000, payload
	e.egress(fin.packet())
	r.tcpFlags, r.ack = tcpFIN|tcpACK, serverAck
	e.ingress(r.packet())
	a.tcpFlags = tcpACK
	e.egress(a.packet())
}

// closedFirst reads the NAT_F_CLOSED_FIRST flag of a's dir-0 entry.
func closedFirst(t *testing.T, e *testEnv, a flow) bool {
	t.Helper()
	if a.src.Is4() {
		var v NATValV4
		k := NATKeyV4{Src: Addr4(a.src), Dst: Addr4(a.dst), Sport: Port(a.sport), Dport: Port(a.dport), Proto: protoTCP, Dir: DirEgress}
		if err := e.dp.Maps.NatV4.Lookup(k, &v); err != nil {
			t.Fatal(err)
		}
		return v.Flags&NATFlagClosedFirst != 0
	}
	var v NATValV6
	k := NATKeyV6{Src: a.src.As16(), Dst: a.dst.As16(), Sport: Port(a.sport), Dport: Port(a.dport), Proto: protoTCP, Dir: DirEgress}
	if err := e.dp.Maps.NatV6.Lookup(k, &v); err != nil {
		t.Fatal(err)
	}
	return v.Flags&NATFlagClosedFirst != 0
}

// TestClosedFirstOnlyWhenServerAcksPodFIN: a pair is closed-first (its
// port may go to another pod after the linger) only when the server's FIN
// acknowledges the pod's FIN, data included: crossing FINs (the server's
// sent before the pod's arrived) leave the server in TIME_WAIT, where it
// would refuse another source's SYN on the tuple. Both families.
func TestClosedFirstOnlyWhenServerAcksPodFIN(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	data := []byte("0123456789") // the FIN ends at 1000 + 10 + 1
	for _, c := range []struct {
		pod, remote, snat netip.Addr
	}{{pod1, remote4, snat4}, {pod6, remote6, snat6}} {
		for i, tc := range []struct {
			payload []byte
			ack     uint32
			want    bool
		}{
			{nil, 1000, false},  // crossing: the server had not seen the FIN
			{nil, 1001, true},   // the server's FIN acknowledges it
			{data, 1010, false}, // crossing, after the data
			{data, 1011, true},
		} {
			a := flow{src: c.pod, dst: c.remote, proto: protoTCP, sport: uint16(40000 + i), dport: 443}
			closeFlow(t, e, a, c.snat, 61000, tc.payload, tc.ack)
			if got := closedFirst(t, e, a); got != tc.want {
				t.Errorf("%v, %d bytes with the FIN, server ACK %d: closed-first %v, want %v",
					c.pod, len(tc.payload), tc.ack, got, tc.want)
			}
			// the next case's connection needs the one port
			if c.pod.Is4() {
				e.age(10 * time.Minute)
			} else {
				e.ageV6(10 * time.Minute)
			}
		}
	}
}

// TestCrossingFINsKeepPortFromOtherPods: after crossing FINs the server
// holds the tuple in TIME_WAIT, so the pair's port does not go to another
// pod's connection while the closing lifetime runs (it still goes to the
// same pod's, whose timestamps keep increasing).
func TestCrossingFINsKeepPortFromOtherPods(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	for _, c := range []struct{ pod, other, remote, snat netip.Addr }{
		{pod1, pod2, remote4, snat4},
		{pod6, netip.MustParseAddr("fd00:10::6"), remote6, snat6},
	} {
		a := flow{src: c.pod, dst: c.remote, proto: protoTCP, sport: 40000, dport: 443}
		closeFlow(t, e, a, c.snat, 61000, nil, 1000)
		if c.pod.Is4() {
			e.age(3 * time.Second)
		} else {
			e.ageV6(3 * time.Second)
		}
		other := flow{src: c.other, dst: c.remote, proto: protoTCP, sport: 40001, dport: 443, tcpFlags: tcpSYN}
		before := e.counters()
		if ret, _ := e.run(e.dp.Egress, other.packet()); ret != tcActShot {
			t.Fatalf("%v: another pod after crossing FINs: verdict %d, want TC_ACT_SHOT", c.other, int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})
		same := flow{src: c.pod, dst: c.remote, proto: protoTCP, sport: 40002, dport: 443, tcpFlags: tcpSYN}
		fromSNATPort(t, e.egress(same.packet()), c.snat, 61000)
	}
}

// TestTakenOverPairStartsClean: a closed-first pair's port taken by another
// pod's connection starts with a reply entry of its own, no flag of the
// old pair's (a FIN there would make the new connection closing), and the
// old pair's FIN record is gone: the new connection's crossing FINs are
// judged on its own sequence numbers.
func TestTakenOverPairStartsClean(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	a := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	closeFlow(t, e, a, snat4, 61000, nil, 1001)
	e.age(3 * time.Second)
	other := flow{src: pod2, dst: remote4, proto: protoTCP, sport: 40001, dport: 443, tcpFlags: tcpSYN}
	fromSNATPort(t, e.egress(other.packet()), snat4, 61000)

	in := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(61000), Proto: protoTCP, Dir: DirIngress}
	var r NATValV4
	if err := e.dp.Maps.NatV4.Lookup(in, &r); err != nil {
		t.Fatal(err)
	}
	if AddrFrom4(r.Addr) != pod2 || HostPort(r.Port) != 40001 || r.Flags != 0 {
		t.Fatalf("reply entry %v:%d flags %#x, want %v:40001 flags 0", AddrFrom4(r.Addr), HostPort(r.Port), r.Flags, pod2)
	}
	var pair *NATPair
	if err := ReadNATPairsV4(e.dp.Maps.NatV4, func(p *NATPair) bool {
		if p.Src.Addr() == pod2 {
			pair = p
		}
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if pair == nil || pair.State != StateTCPSyn {
		t.Fatalf("the new connection's pair: %+v, want state %v", pair, StateTCPSyn)
	}
	// Its own close, crossing: not closed-first, whatever the old pair's
	// FIN was.
	r2 := reply(other, snat4, 61000)
	r2.tcpFlags = tcpSYN | tcpACK
	e.ingress(r2.packet())
	fin := other
	fin.tcpFlags, fin.seq = tcpFIN|tcpACK, 5000
	e.egress(fin.packet())
	r2.tcpFlags, r2.ack = tcpFIN|tcpACK, 1001 // acknowledges the old pair's FIN, not this one
	e.ingress(r2.packet())
	if closedFirst(t, e, other) {
		t.Fatal("the new connection is closed-first on the old pair's FIN record")
	}
}

// TestSearchSeveralRanges: with several NAT ranges (the Kubernetes agent's
// --to-ports=a-b,c-d), a port is as likely as under that agent's one
// MASQUERADE --to-ports rule per range with -m statistic --probability:
// every port is in a range, the 10-port range gets about a quarter of the
// flows beside a 30-port one. The search walks their union: once the ports
// of one range toward a server are all held, every flow gets a port of the
// other (under that agent, a flow that draws the full range is refused).
func TestSearchSeveralRanges(t *testing.T) {
	e := newEnv(t, envOptions{natMax: 8192})
	if err := e.dp.SetPortRanges([][2]uint16{{1024, 1033}, {40000, 40029}}); err != nil {
		t.Fatal(err)
	}
	inA := func(p uint16) bool { return p >= 1024 && p <= 1033 }
	inB := func(p uint16) bool { return p >= 40000 && p <= 40029 }
	// 400 flows, each to a server of its own, so none competes for a port.
	a := 0
	for i := range 400 {
		dst := netip.AddrFrom4([4]byte{198, 51, byte(100 + i/250), byte(1 + i%250)})
		f := flow{src: pod1, dst: dst, proto: protoTCP, sport: uint16(20000 + i), dport: 443, tcpFlags: tcpSYN}
		p := parse(t, e.egress(f.packet()))
		switch {
		case inA(p.sport):
			a++
		case !inB(p.sport):
			t.Fatalf("flow %d got port %d, in no range", i, p.sport)
		}
	}
	// Binomial(400, 1/4): mean 100, sd 8.7; 60-140 is over 4.5 sd.
	if a < 60 || a > 140 {
		t.Fatalf("%d of 400 flows drew the 10-port range of 40, want about 100", a)
	}

	// Every port of the first range held toward remote4.
	clearMap(t, e.dp.Maps.NatV4)
	pod := netip.MustParseAddr("10.0.9.1")
	now := monoNow()
	for p := uint16(1024); p <= 1033; p++ {
		putPair4(t, e, pod, remote4, p, p, now)
	}
	before := e.counters()
	for i := range 20 {
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: uint16(30000 + i), dport: 443, tcpFlags: tcpSYN}
		if p := parse(t, e.egress(f.packet())); !inB(p.sport) {
			t.Fatalf("flow %d got port %d, want one of 40000-40029", i, p.sport)
		}
	}
	e.checkCounters(before, map[Counter]uint64{CounterNATNew: 20, CounterMasqueraded: 20})
}

// TestSetPortRangesRefuses: no range, port 0, inverted ranges.
func TestSetPortRangesRefuses(t *testing.T) {
	e := newEnv(t, envOptions{natMax: 1024})
	for _, rs := range [][][2]uint16{
		nil, {{0, 10}}, {{10, 5}}, {{1000, 2000}, {3000, 2000}},
	} {
		if err := e.dp.SetPortRanges(rs); err == nil {
			t.Errorf("SetPortRanges(%v) accepted", rs)
		}
	}
}
