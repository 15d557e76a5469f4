package bpf

import (
	"bytes"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Connection semantics: inbound flows, which packets start a pair, states
// and lifetimes, reopening and port reuse. See docs/datapath.md.

// natCount counts the NAT entries of a family by direction.
func (e *testEnv) natCount(v6 bool) map[uint8]int {
	e.tb.Helper()
	out := map[uint8]int{}
	if v6 {
		var k NATKeyV6
		var v NATValV6
		it := e.dp.Maps.NatV6.Iterate()
		for it.Next(&k, &v) {
			out[k.Dir]++
		}
		return out
	}
	var k NATKeyV4
	var v NATValV4
	it := e.dp.Maps.NatV4.Iterate()
	for it.Next(&k, &v) {
		out[k.Dir]++
	}
	return out
}

// age moves every IPv4 entry's last packet d into the past, as if the flow
// had been idle that long.
func (e *testEnv) age(d time.Duration) {
	e.tb.Helper()
	ageEntries[NATKeyV4](e.tb, e.dp.Maps.NatV4, d, func(v *NATValV4, t uint64) { v.LastSeenNs, v.CreatedNs = t, t })
}

// ageV6 is age for the IPv6 NAT map.
func (e *testEnv) ageV6(d time.Duration) {
	e.tb.Helper()
	ageEntries[NATKeyV6](e.tb, e.dp.Maps.NatV6, d, func(v *NATValV6, t uint64) { v.LastSeenNs, v.CreatedNs = t, t })
}

// ageEntries sets every entry of m as last seen and created d ago.
func ageEntries[K, V any](tb testing.TB, m *ebpf.Map, d time.Duration, set func(*V, uint64)) {
	tb.Helper()
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	then := uint64(ts.Nano()) - uint64(d)
	var k K
	var v V
	var keys []K
	var vals []V
	it := m.Iterate()
	for it.Next(&k, &v) {
		set(&v, then)
		keys, vals = append(keys, k), append(vals, v)
	}
	for i := range keys {
		if err := m.Put(keys[i], vals[i]); err != nil {
			tb.Fatal(err)
		}
	}
}

func unchanged(t *testing.T, in, out []byte) {
	t.Helper()
	if !bytes.Equal(in, out[:len(in)]) {
		t.Fatal("packet modified")
	}
}

// TestInboundFlowRepliesNotTranslated: a remote that routes to the pod CIDR
// opens a flow to a pod; the pod's answers leave with its own address and
// no NAT pair is made, for TCP, UDP and ICMP echo, IPv4 and IPv6.
func TestInboundFlowRepliesNotTranslated(t *testing.T) {
	for _, c := range []struct {
		name        string
		remote, pod netip.Addr
		proto       uint8
		req, ans    flow
	}{
		{name: "tcp v4", proto: protoTCP,
			req: flow{src: remote4, dst: pod1, proto: protoTCP, sport: 51000, dport: 80, tcpFlags: tcpSYN},
			ans: flow{src: pod1, dst: remote4, proto: protoTCP, sport: 80, dport: 51000, tcpFlags: tcpSYN | tcpACK}},
		{name: "udp v4", proto: protoUDP,
			req: flow{src: remote4, dst: pod1, proto: protoUDP, sport: 51000, dport: 53},
			ans: flow{src: pod1, dst: remote4, proto: protoUDP, sport: 53, dport: 51000}},
		{name: "icmp v4", proto: protoICMP,
			req: flow{src: remote4, dst: pod1, proto: protoICMP, icmpType: 8, sport: 4242},
			ans: flow{src: pod1, dst: remote4, proto: protoICMP, icmpType: 0, sport: 4242}},
		{name: "tcp v6", proto: protoTCP,
			req: flow{src: remote6, dst: pod6, proto: protoTCP, sport: 51000, dport: 80, tcpFlags: tcpSYN},
			ans: flow{src: pod6, dst: remote6, proto: protoTCP, sport: 80, dport: 51000, tcpFlags: tcpSYN | tcpACK}},
		{name: "udp v6", proto: protoUDP,
			req: flow{src: remote6, dst: pod6, proto: protoUDP, sport: 51000, dport: 53},
			ans: flow{src: pod6, dst: remote6, proto: protoUDP, sport: 53, dport: 51000}},
		{name: "icmp v6", proto: protoICMPv6,
			req: flow{src: remote6, dst: pod6, proto: protoICMPv6, icmpType: 128, sport: 4242},
			ans: flow{src: pod6, dst: remote6, proto: protoICMPv6, icmpType: 129, sport: 4242}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, envOptions{})
			v6 := c.req.src.Is6()
			before := e.counters()
			unchanged(t, c.req.packet(), e.ingress(c.req.packet()))
			e.checkCounters(before, map[Counter]uint64{CounterInboundNew: 1})
			for i := range 3 {
				before = e.counters()
				in := c.ans.packet()
				unchanged(t, in, e.egress(in))
				e.checkCounters(before, map[Counter]uint64{CounterSkipInboundReply: 1})
				if c.proto == protoTCP && i == 0 {
					c.ans.tcpFlags = tcpACK // then mid-stream
				}
			}
			if n := e.natCount(v6); n[DirEgress] != 0 || n[DirIngress] != 0 || n[DirInbound] != 1 {
				t.Fatalf("NAT entries by direction %v, want only one inbound record", n)
			}
		})
	}
}

// TestSegmentWithoutPair: a pod's TCP segment that has no NAT pair and no
// inbound record never leaves with the pod's address toward a masqueraded
// destination. A mid-stream segment (ACK, data, FIN) is picked up, as
// nf_conntrack_tcp_loose=1 does: it gets a pair with its own port, counted
// in nat-picked-up, not yet established (60 s) until the remote answers.
// A SYN-ACK or a RST starts nothing and is dropped (drop-no-pair). Toward
// a non-masquerade destination they all pass untranslated and make no
// pair, as before.
func TestSegmentWithoutPair(t *testing.T) {
	e := newEnv(t, envOptions{})
	if err := e.dp.SetKeepSourcePort(true); err != nil { // the agent's default
		t.Fatal(err)
	}
	for _, flags := range []uint8{tcpSYN | tcpACK, tcpRST, tcpRST | tcpACK} {
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: flags}
		before := e.counters()
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
			t.Fatalf("flags %#x without a pair: verdict %d, want TC_ACT_SHOT", flags, int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterDropNoPair: 1})
	}
	if n := e.natCount(false); len(n) != 0 {
		t.Fatalf("NAT entries %v after packets that start no flow", n)
	}
	for i, flags := range []uint8{tcpACK, tcpFIN | tcpACK} {
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: uint16(40001 + i), dport: 443, tcpFlags: flags, payload: []byte("mid")}
		before := e.counters()
		if p := parse(t, e.egress(f.packet())); p.src != snat4 || p.sport != f.sport || p.dst != f.dst || p.dport != f.dport {
			t.Fatalf("picked-up segment leaves as %v:%d -> %v:%d, want %v:%d (its own port) -> %v:%d",
				p.src, p.sport, p.dst, p.dport, snat4, f.sport, f.dst, f.dport)
		}
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATPickedUp: 1, CounterNATPortKept: 1})
		k := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(f.sport), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
		rk := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(f.sport), Proto: protoTCP, Dir: DirIngress}
		var v, rv NATValV4
		if err := e.dp.Maps.NatV4.Lookup(k, &v); err != nil {
			t.Fatal(err)
		}
		if err := e.dp.Maps.NatV4.Lookup(rk, &rv); err != nil {
			t.Fatal(err)
		}
		want := StateTCPSyn
		if flags&tcpFIN != 0 {
			want = StateTCPClosing
		}
		if got := StateOf(protoTCP, v.Flags|rv.Flags); got != want {
			t.Fatalf("picked-up pair (flags %#x) in state %s, want %s", flags, got, want)
		}
		// The remote's answer makes it established; the pod's next
		// segment takes its pair.
		r := reply(f, snat4, f.sport)
		r.tcpFlags = tcpACK
		if p := parse(t, e.ingress(r.packet())); p.dst != pod1 || p.dport != f.sport {
			t.Fatalf("answer translated to %v:%d", p.dst, p.dport)
		}
		if flags&tcpFIN == 0 {
			e.dp.Maps.NatV4.Lookup(rk, &rv)
			if got := StateOf(protoTCP, v.Flags|rv.Flags); got != StateTCPEstablished {
				t.Fatalf("picked-up pair after the answer: %s", got)
			}
		}
		before = e.counters()
		if p := parse(t, e.egress(f.packet())); p.src != snat4 || p.sport != f.sport {
			t.Fatalf("next segment leaves as %v:%d", p.src, p.sport)
		}
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1})
	}
	// Toward a non-masquerade destination (newEnv's 192.168.0.0/16)
	// nothing is made or dropped. The mid-stream segment is picked up as
	// an unmasqueraded flow (recorded: its FIN finds the record); a
	// SYN-ACK or RST starts nothing.
	for _, flags := range []uint8{tcpSYN | tcpACK, tcpRST, tcpACK, tcpFIN | tcpACK} {
		f := flow{src: pod1, dst: netip.MustParseAddr("192.168.1.1"), proto: protoTCP, sport: 40000, dport: 443, tcpFlags: flags}
		before := e.counters()
		in := f.packet()
		unchanged(t, in, e.egress(in))
		want := map[Counter]uint64{CounterSkipNonMasqDst: 1}
		if flags == tcpACK {
			want[CounterUnmasqNew] = 1
		}
		e.checkCounters(before, want)
	}
	if n := e.natCount(false); n[DirEgress] != 2 || n[DirIngress] != 2 {
		t.Fatalf("NAT entries %v, want the two picked-up pairs only", n)
	}
}

// TestSYNReopensClosedPair: after FIN from both sides, a new SYN of the same
// tuple reopens the pair with the same port, as an unanswered flow again.
func TestSYNReopensClosedPair(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	port := masqueraded(t, e.egress(f.packet()), f, snat4)
	r := reply(f, snat4, port)
	e.ingress(r.packet())
	f.tcpFlags, r.tcpFlags = tcpFIN|tcpACK, tcpFIN|tcpACK
	e.egress(f.packet())
	e.ingress(r.packet())

	key := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(40000), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
	rkey := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(port), Proto: protoTCP, Dir: DirIngress}
	var v, rv NATValV4
	e.dp.Maps.NatV4.Lookup(key, &v)
	e.dp.Maps.NatV4.Lookup(rkey, &rv)
	if got := StateOf(protoTCP, v.Flags|rv.Flags); got != StateTCPClosing {
		t.Fatalf("state after FIN both ways: %s", got)
	}

	before := e.counters()
	f.tcpFlags = tcpSYN
	if again := masqueraded(t, e.egress(f.packet()), f, snat4); again != port {
		t.Fatalf("reopened pair got port %d, was %d", again, port)
	}
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATReopened: 1})
	e.dp.Maps.NatV4.Lookup(key, &v)
	e.dp.Maps.NatV4.Lookup(rkey, &rv)
	if got := StateOf(protoTCP, v.Flags|rv.Flags); got != StateTCPSyn {
		t.Fatalf("state after the new SYN: %s, want %s", got, StateTCPSyn)
	}
	// A retransmitted SYN of an open pair does not reopen it.
	before = e.counters()
	e.egress(f.packet())
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1})
}

// TestExpiredPairFreesPort: with one NAT port, an unanswered SYN holds it
// for the SYN lifetime only; after that another pod's flow takes the port
// even though no collector ran.
func TestExpiredPairFreesPort(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	a := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	masqueradedRange(t, e.egress(a.packet()), 61000, 61000)

	b := flow{src: pod2, dst: remote4, proto: protoTCP, sport: 40001, dport: 443}
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, b.packet()); ret != tcActShot {
		t.Fatalf("second flow while the first is fresh: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})

	e.age(DefaultLifetimes.TCPSyn + time.Second)
	before = e.counters()
	masqueradedRange(t, e.egress(b.packet()), 61000, 61000)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATReused: 1})
	if n := e.natCount(false); n[DirEgress] != 1 || n[DirIngress] != 1 {
		t.Fatalf("entries %v: the expired pair's egress entry must go with its port", n)
	}
	// The reply reaches the new flow's pod.
	if p := parse(t, e.ingress(reply(b, snat4, 61000).packet())); p.dst != pod2 || p.dport != 40001 {
		t.Fatalf("reply went to %v:%d", p.dst, p.dport)
	}
}

// TestClosedPairPortReuse: when the server closed first (it holds the
// tuple in TIME_WAIT), a closed pair's port goes to a new connection of the
// same pod to the same server (its TCP timestamps keep increasing, no PAWS
// drop) after a short linger, but not to another pod's while the closing
// lifetime runs.
func TestClosedPairPortReuse(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	a := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	masqueradedRange(t, e.egress(a.packet()), 61000, 61000)
	r := reply(a, snat4, 61000)
	e.ingress(r.packet())
	a.tcpFlags, r.tcpFlags = tcpFIN|tcpACK, tcpFIN|tcpACK
	e.ingress(r.packet()) // the server's FIN first
	e.egress(a.packet())

	other := flow{src: pod2, dst: remote4, proto: protoTCP, sport: 40001, dport: 443}
	same := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40002, dport: 443}
	// Just closed: the last ACK may still be on its way.
	if ret, _ := e.run(e.dp.Egress, same.packet()); ret != tcActShot {
		t.Fatalf("same pod right after close: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.age(5 * time.Second)
	if ret, _ := e.run(e.dp.Egress, other.packet()); ret != tcActShot {
		t.Fatalf("another pod within the closing lifetime: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	before := e.counters()
	masqueradedRange(t, e.egress(same.packet()), 61000, 61000)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATReused: 1})
}

// TestClientClosedPairGoesToAnyPod: when the pod closed first, the server
// closed passively and holds no TIME_WAIT for the tuple, so after the
// linger the closed pair's port goes to another pod's connection too (as
// Linux's conntrack lets any flow take a closed tuple); without this, one
// destination took at most 4 536 new connections per 2 minutes from
// distinct pods. Both families.
func TestClientClosedPairGoesToAnyPod(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	for _, c := range []struct{ pod, other, remote, snat netip.Addr }{
		{pod1, pod2, remote4, snat4},
		{pod6, netip.MustParseAddr("fd00:10::6"), remote6, snat6},
	} {
		a := flow{src: c.pod, dst: c.remote, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
		fromSNATPort(t, e.egress(a.packet()), c.snat, 61000)
		r := reply(a, c.snat, 61000)
		r.tcpFlags = tcpSYN | tcpACK
		e.ingress(r.packet())
		a.tcpFlags, r.tcpFlags = tcpFIN|tcpACK, tcpFIN|tcpACK
		e.egress(a.packet()) // the pod's FIN first (seq 1000)
		r.ack = 1001         // the server's FIN acknowledges it
		e.ingress(r.packet())
		a.tcpFlags = tcpACK
		e.egress(a.packet())

		other := flow{src: c.other, dst: c.remote, proto: protoTCP, sport: 40001, dport: 443, tcpFlags: tcpSYN}
		if ret, _ := e.run(e.dp.Egress, other.packet()); ret != tcActShot {
			t.Fatalf("%v: another pod right after the close: verdict %d, want TC_ACT_SHOT", c.other, int32(ret))
		}
		if c.pod.Is4() {
			e.age(3 * time.Second)
		} else {
			e.ageV6(3 * time.Second)
		}
		before := e.counters()
		fromSNATPort(t, e.egress(other.packet()), c.snat, 61000)
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATReused: 1})
		ro := reply(other, c.snat, 61000)
		ro.tcpFlags = tcpSYN | tcpACK
		if p := parse(t, e.ingress(ro.packet())); p.dst != c.other || p.dport != 40001 {
			t.Fatalf("%v: the new connection's reply went to %v:%d", c.other, p.dst, p.dport)
		}
	}
}

// fromSNATPort checks that a translated packet leaves from snat:port.
func fromSNATPort(t *testing.T, out []byte, snat netip.Addr, port uint16) {
	t.Helper()
	if p := parse(t, out); p.src != snat || p.sport != port {
		t.Fatalf("got %v:%d, want %v:%d", p.src, p.sport, snat, port)
	}
}

// TestClosedPairLingersFromItsClose: the linger before a closed pair's port
// goes to the same pod's next connection counts from the close (the FINs),
// not from the pair's last refresh of last_seen, which is written at most
// once a second: a connection that closes 0.9 s after its last refresh must
// still keep its port for 2 s after the FINs, so the old connection's last
// ACK (or a retransmitted FIN) still finds the pair.
func TestClosedPairLingersFromItsClose(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	a := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	masqueradedRange(t, e.egress(a.packet()), 61000, 61000)
	r := reply(a, snat4, 61000)
	r.tcpFlags = tcpSYN | tcpACK
	e.ingress(r.packet())
	// The pair's last refresh was 0.9 s ago; the FINs come now, within
	// the refresh interval.
	e.age(900 * time.Millisecond)
	a.tcpFlags, r.tcpFlags = tcpFIN|tcpACK, tcpFIN|tcpACK
	e.egress(a.packet())
	e.ingress(r.packet())
	a.tcpFlags = tcpACK
	e.egress(a.packet()) // the last ACK

	same := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40002, dport: 443, tcpFlags: tcpSYN}
	time.Sleep(1500 * time.Millisecond)
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, same.packet()); ret != tcActShot {
		t.Fatalf("same pod 1.5 s after the close (2.4 s after the last refresh): verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})
	time.Sleep(700 * time.Millisecond)
	before = e.counters()
	masqueradedRange(t, e.egress(same.packet()), 61000, 61000)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATReused: 1})
}

// TestLostReplyEntryRestored: a pair that lost its reply entry (evicted)
// gets it back from the next egress packet.
func TestLostReplyEntryRestored(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 5000, dport: 53}
	port := masqueraded(t, e.egress(f.packet()), f, snat4)
	rkey := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(53), Dport: Port(port), Proto: protoUDP, Dir: DirIngress}
	if err := e.dp.Maps.NatV4.Delete(rkey); err != nil {
		t.Fatal(err)
	}
	e.age(2 * time.Second) // the check runs at most once a second per pair
	if again := masqueraded(t, e.egress(f.packet()), f, snat4); again != port {
		t.Fatalf("port %d, was %d", again, port)
	}
	if p := parse(t, e.ingress(reply(f, snat4, port).packet())); p.dst != pod1 || p.dport != 5000 {
		t.Fatalf("reply went to %v:%d", p.dst, p.dport)
	}
}

// TestResizedNATMapKeepsPairs: loading with another --nat-max-entries
// replaces the pinned NAT maps, copying their pairs first: established
// flows keep their ports and their replies are still translated.
func TestResizedNATMapKeepsPairs(t *testing.T) {
	e := newEnv(t, envOptions{natMax: 64})
	f4 := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	port4 := masqueraded(t, e.egress(f4.packet()), f4, snat4)
	f6 := flow{src: pod6, dst: remote6, proto: protoUDP, sport: 40000, dport: 53}
	port6 := masqueraded(t, e.egress(f6.packet()), f6, snat6)

	for _, size := range []uint32{4096, 32} {
		e.reload(t, LoadOptions{NATMaxEntries: size})
		if got := e.dp.Maps.NatV4.MaxEntries(); got != size {
			t.Fatalf("nat_v4 holds %d entries, want %d", got, size)
		}
		f4.tcpFlags = tcpACK
		if got := masqueraded(t, e.egress(f4.packet()), f4, snat4); got != port4 {
			t.Fatalf("size %d: NAT port %d, before %d", size, got, port4)
		}
		if p := parse(t, e.ingress(reply(f4, snat4, port4).packet())); p.dst != pod1 || p.dport != 40000 {
			t.Fatalf("size %d: reply went to %v:%d", size, p.dst, p.dport)
		}
		if got := masqueraded(t, e.egress(f6.packet()), f6, snat6); got != port6 {
			t.Fatalf("size %d: IPv6 NAT port %d, before %d", size, got, port6)
		}
	}
}

// TestNATMapUpgradedToHash: a node upgraded from a version whose NAT maps
// were LRU maps, or preallocated hash maps, keeps its pairs: the pinned
// map's entries are copied into the BPF_F_NO_PREALLOC hash map that
// replaces it, and the pairs' counts follow.
func TestNATMapUpgradedToHash(t *testing.T) {
	for _, typ := range []ebpf.MapType{ebpf.LRUHash, ebpf.Hash} {
		t.Run(typ.String(), func(t *testing.T) {
			e := newEnv(t, envOptions{natMax: 64})
			f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
			port := masqueraded(t, e.egress(f.packet()), f, snat4)
			e.ingress(reply(f, snat4, port).packet())

			// Put an old-style map with the same entries where the map is pinned.
			cur := e.dp.Maps.NatV4
			old, err := ebpf.NewMap(&ebpf.MapSpec{Type: typ, KeySize: cur.KeySize(),
				ValueSize: cur.ValueSize(), MaxEntries: cur.MaxEntries()})
			if err != nil {
				t.Fatal(err)
			}
			defer old.Close()
			var k NATKeyV4
			var v NATValV4
			n := 0
			for it := cur.Iterate(); it.Next(&k, &v); n++ {
				if err := old.Put(k, v); err != nil {
					t.Fatal(err)
				}
			}
			if n != 2 {
				t.Fatalf("%d entries before the upgrade, want 2", n)
			}
			path := filepath.Join(e.pinDir, MapNATV4)
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			if err := old.Pin(path); err != nil {
				t.Fatal(err)
			}

			e.reload(t, LoadOptions{NATMaxEntries: 64})
			if got := e.dp.Maps.NatV4.Type(); got != ebpf.Hash || e.dp.Maps.NatV4.Flags()&unix.BPF_F_NO_PREALLOC == 0 {
				t.Fatalf("nat_v4 is a %s (flags %#x) after the upgrade, want a Hash with BPF_F_NO_PREALLOC", got, e.dp.Maps.NatV4.Flags())
			}
			checkNATCounts(t, e.dp)
			before := e.counters()
			f.tcpFlags = tcpACK
			if got := masqueraded(t, e.egress(f.packet()), f, snat4); got != port {
				t.Fatalf("NAT port %d after the upgrade, before %d", got, port)
			}
			e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1})
			if p := parse(t, e.ingress(reply(f, snat4, port).packet())); p.dst != pod1 || p.dport != 40000 {
				t.Fatalf("reply went to %v:%d after the upgrade", p.dst, p.dport)
			}
		})
	}
}

// TestNodeFlowPortHeldFromNAT: a node socket that bound a port of the NAT
// range talks to a remote; no pod flow to that remote gets that port, and
// the remote's replies reach the node untranslated.
func TestNodeFlowPortHeldFromNAT(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	if err := e.dp.Maps.NodeAddrsV4.Put(snat4.As4(), uint8(1)); err != nil {
		t.Fatal(err)
	}
	node := flow{src: snat4, dst: remote4, proto: protoUDP, sport: 61000, dport: 53}
	before := e.counters()
	in := node.packet()
	unchanged(t, in, e.egress(in))
	e.checkCounters(before, map[Counter]uint64{CounterSkipNotSource: 1, CounterHostFlowNew: 1})

	pod := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 5000, dport: 53}
	before = e.counters()
	if ret, _ := e.run(e.dp.Egress, pod.packet()); ret != tcActShot {
		t.Fatalf("pod flow while the node holds the only port: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})

	r := flow{src: remote4, dst: snat4, proto: protoUDP, sport: 53, dport: 61000}
	before = e.counters()
	in = r.packet()
	unchanged(t, in, e.ingress(in))
	e.checkCounters(before, map[Counter]uint64{})

	// Another remote is free to use the port.
	other := flow{src: pod1, dst: netip.MustParseAddr("1.1.1.1"), proto: protoUDP, sport: 5000, dport: 53}
	masqueradedRange(t, e.egress(other.packet()), 61000, 61000)
	// Once the node flow is idle past its lifetime, the port is free again.
	e.age(DefaultLifetimes.UDPStream + time.Second)
	masqueradedRange(t, e.egress(pod.packet()), 61000, 61000)
}

// TestPodErrorAboutInboundFlow: a remote's UDP probe to a pod port (an
// inbound flow, recorded on ingress) is answered by the pod with an ICMP
// port unreachable; the error leaves untranslated from the pod's address,
// as Linux passes it, IPv4 and IPv6. The same error about a flow nobody
// opened is still dropped.
func TestPodErrorAboutInboundFlow(t *testing.T) {
	e := newEnv(t, envOptions{})
	for _, c := range []struct {
		pod, remote netip.Addr
		typ, code   uint8
	}{{pod1, remote4, 3, 3}, {pod6, remote6, 1, 4}} {
		probe := flow{src: c.remote, dst: c.pod, proto: protoUDP, sport: 5353, dport: 7012, payload: []byte("probe")}
		unchanged(t, probe.packet(), e.ingress(probe.packet()))
		quote := probe.packet()[14:]
		errPkt := icmpError(c.pod, c.remote, c.typ, c.code, quote)
		before := e.counters()
		unchanged(t, errPkt, e.egress(errPkt))
		e.checkCounters(before, map[Counter]uint64{CounterSkipInboundReply: 1})

		// No inbound record for this one: dropped, the pod's address stays in.
		other := probe
		other.sport = 5354
		errPkt = icmpError(c.pod, c.remote, c.typ, c.code, other.packet()[14:])
		before = e.counters()
		if ret, _ := e.run(e.dp.Egress, errPkt); ret != tcActShot {
			t.Fatalf("%s: error about no known flow: verdict %d, want TC_ACT_SHOT", c.pod, int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterICMPErrorUnknown: 1})
	}
}

// udpState is the state of the IPv4 UDP pair of f (translated to port).
func (e *testEnv) udpState(t *testing.T, f flow, port uint16) NATState {
	t.Helper()
	k := NATKeyV4{Src: Addr4(f.src), Dst: Addr4(f.dst), Sport: Port(f.sport), Dport: Port(f.dport), Proto: protoUDP, Dir: DirEgress}
	rk := NATKeyV4{Src: Addr4(f.dst), Dst: Addr4(snat4), Sport: Port(f.dport), Dport: Port(port), Proto: protoUDP, Dir: DirIngress}
	var v, rv NATValV4
	if err := e.dp.Maps.NatV4.Lookup(k, &v); err != nil {
		t.Fatalf("egress entry: %v", err)
	}
	if err := e.dp.Maps.NatV4.Lookup(rk, &rv); err != nil {
		t.Fatalf("reply entry: %v", err)
	}
	return StateOf(protoUDP, v.Flags|rv.Flags)
}

// TestUDPLifetimes: as conntrack, a UDP query and its answer live the
// short UDP lifetime (30 s), and only a flow still active 2 s after it
// started, answered, becomes a stream with the replied lifetime (2 min).
// The clock is the entries' own: they are aged instead of waiting. An
// answered query 31 s idle has expired: its port goes to a new flow.
func TestUDPLifetimes(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	q := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 40000, dport: 53, payload: []byte("q")}
	port := masqueraded(t, e.egress(q.packet()), q, snat4)
	if s := e.udpState(t, q, port); s != StateUDP {
		t.Fatalf("query: %s", s)
	}
	a := reply(q, snat4, port)
	e.ingress(a.packet())
	if s := e.udpState(t, q, port); s != StateUDP {
		t.Fatalf("query answered at once: %s, want %s (30 s)", s, StateUDP)
	}
	// Answered again within 2 s of its start: still a query's lifetime.
	e.ingress(a.packet())
	masqueraded(t, e.egress(q.packet()), q, snat4)
	if s := e.udpState(t, q, port); s != StateUDP {
		t.Fatalf("exchanges within 2 s: %s, want %s", s, StateUDP)
	}
	// The same flow 3 s after it started, answered before: a stream, by
	// an answer and by the pod's next datagram (the egress path checks
	// once a second).
	for _, dir := range []string{"answer", "pod's datagram"} {
		e.age(3 * time.Second)
		k := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(53), Dport: Port(port), Proto: protoUDP, Dir: DirIngress}
		var rv NATValV4
		e.dp.Maps.NatV4.Lookup(k, &rv)
		rv.Flags &^= NATFlagStream
		e.dp.Maps.NatV4.Put(k, rv)
		if dir == "answer" {
			e.ingress(a.packet())
		} else {
			masqueraded(t, e.egress(q.packet()), q, snat4)
		}
		if s := e.udpState(t, q, port); s != StateUDPStream {
			t.Fatalf("%s 3 s after the start: %s, want %s (2 min)", dir, s, StateUDPStream)
		}
	}

	// Another query and answer, idle 31 s: expired; the one-port range's
	// port goes to a new flow at once.
	e2 := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	port = masqueraded(t, e2.egress(q.packet()), q, snat4)
	e2.ingress(reply(q, snat4, port).packet())
	other := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 40001, dport: 53, payload: []byte("q")}
	e2.age(29 * time.Second)
	if ret, _ := e2.run(e2.dp.Egress, other.packet()); ret != tcActShot {
		t.Fatalf("answered query 29 s idle: its port was taken (verdict %d)", int32(ret))
	}
	e2.age(31 * time.Second)
	if got := masqueraded(t, e2.egress(other.packet()), other, snat4); got != port {
		t.Fatalf("new flow got port %d, want the expired query's %d", got, port)
	}
}

// TestFullTableSparesAssured: a table full of established TCP pairs (each
// SYN answered) refuses a new flow, counted in drop-nat-table-full, and
// keeps every established pair whole; it evicts nothing. Once one pair
// closes (a FIN from the remote), a new flow is admitted in its place
// after the 100 ms during which a full table is not searched again.
func TestFullTableSparesAssured(t *testing.T) {
	const natMax = 16 // 8 pairs
	e := newEnv(t, envOptions{natMax: natMax})
	var est []flow
	var ports []uint16
	for i := range natMax / 2 {
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: uint16(40000 + i), dport: 443, tcpFlags: tcpSYN}
		port := masqueraded(t, e.egress(f.packet()), f, snat4)
		e.ingress(reply(f, snat4, port).packet())
		est, ports = append(est, f), append(ports, port)
	}
	for _, proto := range []uint8{protoTCP, protoUDP} {
		f := flow{src: pod1, dst: remote4, proto: proto, sport: 50000, dport: 443, tcpFlags: tcpSYN}
		before := e.counters()
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
			t.Fatalf("new %d flow with the table full of established pairs: verdict %d, want TC_ACT_SHOT", proto, int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterNATFull: 1})
	}
	for i, f := range est {
		f.tcpFlags = tcpACK
		if got := masqueraded(t, e.egress(f.packet()), f, snat4); got != ports[i] {
			t.Fatalf("established pair %d: port %d, was %d", i, got, ports[i])
		}
		if p := parse(t, e.ingress(reply(f, snat4, ports[i]).packet())); p.dst != pod1 || p.dport != f.sport {
			t.Fatalf("established pair %d: reply to %v:%d", i, p.dst, p.dport)
		}
	}
	if n := e.natCount(false); n[DirEgress] != natMax/2 || n[DirIngress] != natMax/2 {
		t.Fatalf("entries by direction %v, want the %d established pairs", n, natMax/2)
	}

	// The remote closes one: it may be dropped for a new flow.
	r := reply(est[0], snat4, ports[0])
	r.tcpFlags = tcpFIN | tcpACK
	e.ingress(r.packet())
	time.Sleep(150 * time.Millisecond) // past the search backoff
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 50001, dport: 443, tcpFlags: tcpSYN}
	before := e.counters()
	masqueraded(t, e.egress(f.packet()), f, snat4)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATEarlyDrop: 1})
	k := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(est[0].sport), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
	var v NATValV4
	if err := e.dp.Maps.NatV4.Lookup(k, &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Fatalf("the closed pair's egress half outlived its drop: %v", err)
	}
}

// udpQueries sends n UDP queries from pod1 (source ports from sport) and
// returns them with their NAT ports; answered ones get their answer.
func udpQueries(t *testing.T, e *testEnv, sport uint16, n int, answered bool) ([]flow, []uint16) {
	t.Helper()
	var fs []flow
	var ports []uint16
	for i := range n {
		f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: sport + uint16(i), dport: 53, payload: []byte("q")}
		port := masqueraded(t, e.egress(f.packet()), f, snat4)
		if answered {
			e.ingress(reply(f, snat4, port).packet())
		}
		fs, ports = append(fs, f), append(ports, port)
	}
	return fs, ports
}

// stillPaired says whether query f still has its pair: its answer goes back
// to the pod.
func stillPaired(t *testing.T, e *testEnv, f flow, port uint16) bool {
	t.Helper()
	ret, out := e.run(e.dp.Ingress, reply(f, snat4, port).packet())
	return ret == tcActUnspec && parse(t, out).dst == pod1
}

// TestEarlyDropTakesAnsweredBeforeInFlight: in a full table of UDP queries,
// 12 waiting for their answers and 4 answered, each of 4 new flows drops an
// answered query's pair, never one whose answer is on its way (the map is
// walked from its first bucket: the first pair found there is as likely to
// be a query in flight). The table holds no more pairs than the search
// reads whole, every note weighed (NAT_EARLY_DROP_SLOTS), so the outcome
// does not depend on where the hash puts them.
func TestEarlyDropTakesAnsweredBeforeInFlight(t *testing.T) {
	const natMax = 32 // 16 pairs
	e := newEnv(t, envOptions{natMax: natMax})
	udpQueries(t, e, 30000, 4, true)
	inFlight, ports := udpQueries(t, e, 40000, natMax/2-4, false)
	for i := range 4 {
		time.Sleep(110 * time.Millisecond) // past a refused search's backoff, if any
		f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: uint16(50000 + i), dport: 53, payload: []byte("q")}
		before := e.counters()
		masqueraded(t, e.egress(f.packet()), f, snat4)
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATEarlyDrop: 1})
	}
	for i, f := range inFlight {
		if !stillPaired(t, e, f, ports[i]) {
			t.Errorf("query %d (in flight) lost its pair to early drop while answered ones could go", i)
		}
	}
}

// TestEarlyDropTakesTheIdlest: in a full table of unanswered UDP flows,
// half idle for 10 s and half new, each of 4 new flows drops an idle one
// (16 pairs: every one is weighed, see above).
func TestEarlyDropTakesTheIdlest(t *testing.T) {
	const natMax = 32 // 16 pairs
	e := newEnv(t, envOptions{natMax: natMax})
	udpQueries(t, e, 30000, natMax/4, false)
	e.age(10 * time.Second)
	young, ports := udpQueries(t, e, 40000, natMax/4, false)
	for i := range 4 {
		f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: uint16(50000 + i), dport: 53, payload: []byte("q")}
		masqueraded(t, e.egress(f.packet()), f, snat4)
	}
	for i, f := range young {
		if !stillPaired(t, e, f, ports[i]) {
			t.Errorf("new flow %d lost its pair to early drop while flows idle for 10 s could go", i)
		}
	}
}

// TestIdleEstablishedPairLivesLikeConntrack: an answered TCP connection
// idle for 7 hours (a pooled connection, keepalives off) keeps its pair
// and its NAT port, as conntrack keeps an established entry 5 days
// (nf_conntrack_tcp_timeout_established 432000 s): another pod's flow
// does not take the port, and the connection's next segment leaves from
// the same port, not picked up anew. Past 5 days the port is free again.
func TestIdleEstablishedPairLivesLikeConntrack(t *testing.T) {
	if want := 432000 * time.Second; DefaultLifetimes.TCPEstablished != want {
		t.Fatalf("established TCP lifetime %s, conntrack's is %s", DefaultLifetimes.TCPEstablished, want)
	}
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	a := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	masqueradedRange(t, e.egress(a.packet()), 61000, 61000)
	e.ingress(reply(a, snat4, 61000).packet())

	e.age(7 * time.Hour)
	b := flow{src: pod2, dst: remote4, proto: protoTCP, sport: 40001, dport: 443}
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, b.packet()); ret != tcActShot {
		t.Fatalf("another pod's flow while the idle connection lives: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})
	a.tcpFlags = tcpACK
	before = e.counters()
	masqueradedRange(t, e.egress(a.packet()), 61000, 61000)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1})

	e.age(DefaultLifetimes.TCPEstablished + time.Second)
	before = e.counters()
	masqueradedRange(t, e.egress(b.packet()), 61000, 61000)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATReused: 1})
}

// pairFlags reads the flags of both entries of the IPv4 TCP pair of f
// (egress) translated to port.
func (e *testEnv) pairFlags(t *testing.T, f flow, port uint16) (out, in uint8) {
	t.Helper()
	var v NATValV4
	k := NATKeyV4{Src: Addr4(f.src), Dst: Addr4(f.dst), Sport: Port(f.sport), Dport: Port(f.dport), Proto: f.proto, Dir: DirEgress}
	if err := e.dp.Maps.NatV4.Lookup(k, &v); err != nil {
		t.Fatalf("egress entry: %v", err)
	}
	out = v.Flags
	k = NATKeyV4{Src: Addr4(f.dst), Dst: Addr4(snat4), Sport: Port(f.dport), Dport: Port(port), Proto: f.proto, Dir: DirIngress}
	if err := e.dp.Maps.NatV4.Lookup(k, &v); err != nil {
		t.Fatalf("reply entry: %v", err)
	}
	return out, v.Flags
}

// TestBlindRSTKeepsEstablishedPair: a RST ends an established pair only
// when its sequence number is one the receiver expects, as conntrack
// checks it (nf_conntrack_proto_tcp.c): the remote's, the end of what it
// sent (the pod's RCV.NXT once it arrived, or right after data the pod has
// not acknowledged yet); the pod's, within the window at or below the end
// of what it sent. A RST with any other sequence number (a blind one from
// off the path, an outdated one, or the pod's own out of window) is still
// translated and delivered, the receiver judges it (RFC 5961), but the pair
// stays established: it is not early drop's victim and its port does not
// go to another flow. Counted in tcp-rst-ignored.
func TestBlindRSTKeepsEstablishedPair(t *testing.T) {
	for _, c := range []struct {
		name      string
		remoteRST bool   // the remote's RST, else the pod's
		seq       uint32 // the RST's sequence number
		ends      bool
	}{
		{"remote, blind", true, 0x7000_0000, false},
		{"remote, in the window but not expected", true, 5011 + 100, false},
		{"remote, the pod's last ack, older than what passed", true, 5011, false},
		{"remote, after its unacknowledged data", true, 5021, true},
		{"pod, blind", false, 0x7000_0000, false},
		{"pod, its own next sequence number", false, 1001, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
			a := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN, seq: 1000}
			masqueradedRange(t, e.egress(a.packet()), 61000, 61000)
			r := reply(a, snat4, 61000)
			r.seq, r.ack = 5000, 1001
			e.ingress(r.packet())
			a.tcpFlags, a.seq, a.ack = tcpACK, 1001, 5001
			e.egress(a.packet())
			r.tcpFlags, r.seq, r.payload = tcpACK, 5001, []byte("0123456789")
			e.ingress(r.packet())
			a.ack = 5011
			e.egress(a.packet())
			// More data the pod has not acknowledged yet.
			r.seq = 5011
			e.ingress(r.packet())

			before := e.counters()
			if c.remoteRST {
				rst := r
				rst.tcpFlags, rst.seq, rst.ack, rst.payload = tcpRST|tcpACK, c.seq, 1001, nil
				if p := parse(t, e.ingress(rst.packet())); p.dst != pod1 || p.dport != 40000 {
					t.Fatalf("the RST went to %v:%d, want the pod", p.dst, p.dport)
				}
			} else {
				rst := a
				rst.tcpFlags, rst.seq = tcpRST|tcpACK, c.seq
				masqueradedRange(t, e.egress(rst.packet()), 61000, 61000)
			}
			want := map[Counter]uint64{CounterReverse: 1}
			if !c.remoteRST {
				want = map[Counter]uint64{CounterMasqueraded: 1}
			}
			if !c.ends {
				want[CounterTCPRSTIgnored] = 1
			}
			e.checkCounters(before, want)
			out, in := e.pairFlags(t, a, 61000)
			if got := StateOf(protoTCP, out|in); (got == StateTCPReset) != c.ends {
				t.Fatalf("pair state %s after the RST, want reset %v", got, c.ends)
			}
			// Past the reset lifetime, another pod's flow gets the port
			// only if the RST ended the pair.
			e.age(DefaultLifetimes.TCPReset + time.Second)
			b := flow{src: pod2, dst: remote4, proto: protoTCP, sport: 40001, dport: 443}
			ret, _ := e.run(e.dp.Egress, b.packet())
			if (ret == tcActUnspec) != c.ends {
				t.Fatalf("another pod's flow after the RST: verdict %d, want the port taken over %v", int32(ret), c.ends)
			}
		})
	}
}

// TestNATMapShorterValuesUpgraded: a node upgraded from a version whose NAT
// values were shorter (before tcp_end) keeps its pairs: the pinned map's
// entries are copied with the new field zero, and an established flow
// keeps its port, its replies still translated. Its RSTs are not checked
// until each direction has been seen again (the field is unknown).
func TestNATMapShorterValuesUpgraded(t *testing.T) {
	e := newEnv(t, envOptions{natMax: 64})
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	port := masqueraded(t, e.egress(f.packet()), f, snat4)
	e.ingress(reply(f, snat4, port).packet())

	cur := e.dp.Maps.NatV4
	const oldSize = 24 // struct nat_v4_val before tcp_end
	old, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: cur.KeySize(), ValueSize: oldSize,
		MaxEntries: cur.MaxEntries(), Flags: cur.Flags()})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	var k NATKeyV4
	var v []byte
	for it := cur.Iterate(); it.Next(&k, &v); {
		if err := old.Put(k, v[:oldSize]); err != nil {
			t.Fatal(err)
		}
	}
	path := filepath.Join(e.pinDir, MapNATV4)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := old.Pin(path); err != nil {
		t.Fatal(err)
	}
	e.reload(t, LoadOptions{NATMaxEntries: 64})
	if got := e.dp.Maps.NatV4.ValueSize(); got <= oldSize {
		t.Fatalf("nat_v4 values of %d bytes after the upgrade", got)
	}
	if n := e.natCount(false); n[DirEgress] != 1 || n[DirIngress] != 1 {
		t.Fatalf("entries %v after the upgrade, want the pair", n)
	}
	f.tcpFlags = tcpACK
	if got := masqueraded(t, e.egress(f.packet()), f, snat4); got != port {
		t.Fatalf("NAT port %d after the upgrade, before %d", got, port)
	}
	if p := parse(t, e.ingress(reply(f, snat4, port).packet())); p.dst != pod1 || p.dport != 40000 {
		t.Fatalf("reply went to %v:%d after the upgrade", p.dst, p.dport)
	}
}
