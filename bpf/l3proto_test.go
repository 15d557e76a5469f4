package bpf

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"net/netip"
	"slices"
	"testing"
	"time"
)

// Tests of the ICMP-error-on-egress, SCTP and address-only paths. Every
// expected packet is built from scratch in Go (packet_test.go computes the
// IPv4 header, L4 and ICMP/ICMPv6 checksums, pseudo headers included) and
// compared byte for byte with what the program made of its input.

const (
	protoGRE  = 47
	protoESP  = 50
	protoSCTP = 132
	protoTest = 253 // RFC 3692 experimentation
	protoDCCP = 33
	protoLite = 136 // UDP-Lite
)

// sctpPacket builds an SCTP packet (common header and one DATA-like chunk)
// with its CRC32c, wrapped in IP and Ethernet.
func sctpPacket(src, dst netip.Addr, sport, dport uint16) []byte {
	b := make([]byte, 12, 28)
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	binary.BigEndian.PutUint32(b[4:], 0xdecafbad) // verification tag
	b = append(b, 0, 0, 0, 16, 's', 'c', 't', 'p', ' ', 'c', 'h', 'u', 'n', 'k', '!', '!')
	binary.LittleEndian.PutUint32(b[8:], crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)))
	return ether(ipPacket(src, dst, protoSCTP, 1, 0, b))
}

// checkSCTP verifies the CRC32c of the SCTP packet in a frame.
func checkSCTP(t *testing.T, frame []byte) parsed {
	t.Helper()
	p := parseIP(t, frame[14:])
	b := bytes.Clone(p.l4)
	want := binary.LittleEndian.Uint32(b[8:])
	clear(b[8:12])
	if got := crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)); got != want {
		t.Fatalf("SCTP CRC32c %#x, want %#x", want, got)
	}
	p.sport = binary.BigEndian.Uint16(p.l4[0:])
	p.dport = binary.BigEndian.Uint16(p.l4[2:])
	return p
}

// opaque builds a packet of a protocol translated address-only; ICMPv6,
// DCCP and UDP-Lite get their checksums (pseudo header included).
func opaque(src, dst netip.Addr, proto uint8) []byte {
	f := flow{src: src, dst: dst, proto: proto, payload: []byte("opaque payload")}
	if proto == protoDCCP || proto == protoLite {
		b := append(make([]byte, 16), f.payload...)
		binary.BigEndian.PutUint16(b[0:], 1234)
		binary.BigEndian.PutUint16(b[2:], 5678)
		binary.BigEndian.PutUint16(b[6:], csumFold(csumAdd(pseudoSum(src, dst, proto, len(b)), b)))
		return ether(ipPacket(src, dst, proto, 1, 0, b))
	}
	if proto == protoICMP || proto == protoICMPv6 {
		f.icmpType = 13 // ICMPv4 timestamp; ICMPv6: unassigned informational
		if proto == protoICMPv6 {
			f.icmpType = 200
		}
		return f.packet()
	}
	return ether(ipPacket(src, dst, proto, 1, 0, f.payload))
}

func TestSCTPKeepsPortAndCRC(t *testing.T) {
	e := newEnv(t, envOptions{})
	for _, c := range []struct{ pod, pod2, remote, snat netip.Addr }{
		{pod1, pod2, remote4, snat4},
		{pod6, netip.MustParseAddr("fd00:10::6"), remote6, snat6},
	} {
		before := e.counters()
		out := checkSCTP(t, e.egress(sctpPacket(c.pod, c.remote, 5000, 38412)))
		if out.src != c.snat || out.dst != c.remote || out.sport != 5000 || out.dport != 38412 {
			t.Fatalf("SCTP egress %v:%d -> %v:%d, want %v:5000 -> %v:38412", out.src, out.sport, out.dst, out.dport, c.snat, c.remote)
		}
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATNewSCTP: 1})

		// The answer reaches the pod, CRC still valid.
		before = e.counters()
		back := checkSCTP(t, e.ingress(sctpPacket(c.remote, c.snat, 38412, 5000)))
		if back.src != c.remote || back.dst != c.pod || back.dport != 5000 {
			t.Fatalf("SCTP ingress %v -> %v:%d, want %v -> %v:5000", back.src, back.dst, back.dport, c.remote, c.pod)
		}
		e.checkCounters(before, map[Counter]uint64{CounterReverse: 1})

		// A second pod with the same port to the same remote and port
		// cannot share the pair: dropped and counted, never sent out
		// with a translation whose answers reach the first pod.
		before = e.counters()
		if ret, _ := e.run(e.dp.Egress, sctpPacket(c.pod2, c.remote, 5000, 38412)); ret != tcActShot {
			t.Fatalf("second pod's SCTP with the same port: verdict %d, want TC_ACT_SHOT", int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterPairTaken: 1})
		// Another port is another pair.
		out = checkSCTP(t, e.egress(sctpPacket(c.pod2, c.remote, 5001, 38412)))
		if out.src != c.snat || out.sport != 5001 {
			t.Fatalf("second pod's SCTP on its own port: %v:%d", out.src, out.sport)
		}
	}
}

func TestAddressOnlyProtocols(t *testing.T) {
	e := newEnv(t, envOptions{})
	other4, other6 := netip.MustParseAddr("9.9.9.9"), netip.MustParseAddr("2001:4860::9999")
	for _, c := range []struct {
		name                string
		proto               uint8
		pod, pod2, remote   netip.Addr
		snat, anotherRemote netip.Addr
	}{
		{"GRE v4", protoGRE, pod1, pod2, remote4, snat4, other4},
		{"ESP v4", protoESP, pod1, pod2, remote4, snat4, other4},
		{"protocol 253 v4", protoTest, pod1, pod2, remote4, snat4, other4},
		{"ICMP timestamp v4", protoICMP, pod1, pod2, remote4, snat4, other4},
		{"DCCP v4", protoDCCP, pod1, pod2, remote4, snat4, other4},
		{"UDP-Lite v6", protoLite, pod6, netip.MustParseAddr("fd00:10::6"), remote6, snat6, other6},
		{"ESP v6", protoESP, pod6, netip.MustParseAddr("fd00:10::6"), remote6, snat6, other6},
		{"ICMPv6 informational", protoICMPv6, pod6, netip.MustParseAddr("fd00:10::6"), remote6, snat6, other6},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := e.counters()
			out := e.egress(opaque(c.pod, c.remote, c.proto))
			if want := opaque(c.snat, c.remote, c.proto); !bytes.Equal(out, want) {
				t.Fatalf("egress:\n got %x\nwant %x", out, want)
			}
			e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATNewAddrOnly: 1})

			before = e.counters()
			back := e.ingress(opaque(c.remote, c.snat, c.proto))
			if want := opaque(c.remote, c.pod, c.proto); !bytes.Equal(back, want) {
				t.Fatalf("ingress:\n got %x\nwant %x", back, want)
			}
			e.checkCounters(before, map[Counter]uint64{CounterReverse: 1})

			// Established: one lookup, same translation.
			if out := e.egress(opaque(c.pod, c.remote, c.proto)); !bytes.Equal(out, opaque(c.snat, c.remote, c.proto)) {
				t.Fatal("second packet translated differently")
			}

			before = e.counters()
			if ret, _ := e.run(e.dp.Egress, opaque(c.pod2, c.remote, c.proto)); ret != tcActShot {
				t.Fatalf("second pod, same remote and protocol: verdict %d, want TC_ACT_SHOT", int32(ret))
			}
			e.checkCounters(before, map[Counter]uint64{CounterPairTaken: 1})
			if out := e.egress(opaque(c.pod2, c.anotherRemote, c.proto)); !bytes.Equal(out, opaque(c.snat, c.anotherRemote, c.proto)) {
				t.Fatal("second pod to another remote not translated")
			}
		})
	}
}

// TestICMPErrorOnEgress: errors about a flow the node translated, sent by
// the node (frag needed / packet too big while forwarding the remote's
// packet to the pod) or by the pod (port unreachable), leave with the
// quote in the remote's view: exactly the packet the remote sent.
func TestICMPErrorOnEgress(t *testing.T) {
	e := newEnv(t, envOptions{})
	nodeLocal4, nodeLocal6 := host, netip.MustParseAddr("fd00:ffff::1") // node addresses, not masquerade sources
	cases := []struct {
		name       string
		f          flow // the pod's flow
		sctp       bool
		from       netip.Addr // the error's sender
		typ, code  uint8
		fromPod    bool
		truncateTo int // quote length, 0: whole packet
	}{
		{"v4 UDP frag needed from the node", flow{src: pod1, dst: remote4, proto: protoUDP, sport: 42000, dport: 7001, payload: []byte("big")}, false, snat4, 3, 4, false, 0},
		{"v4 UDP port unreachable from the pod", flow{src: pod1, dst: remote4, proto: protoUDP, sport: 42001, dport: 7001, payload: []byte("q")}, false, pod1, 3, 3, true, 0},
		{"v4 TCP frag needed, 8-byte quote", flow{src: pod1, dst: remote4, proto: protoTCP, sport: 42002, dport: 443, payload: []byte("data")}, false, nodeLocal4, 3, 4, false, 28},
		{"v4 echo reply time exceeded", flow{src: pod1, dst: remote4, proto: protoICMP, icmpType: 8, sport: 4242, payload: []byte("p")}, false, nodeLocal4, 11, 0, false, 0},
		{"v4 SCTP port unreachable from the pod", flow{src: pod1, dst: remote4, proto: protoSCTP, sport: 5005, dport: 38412}, true, pod1, 3, 3, true, 0},
		{"v6 UDP packet too big from the node", flow{src: pod6, dst: remote6, proto: protoUDP, sport: 42000, dport: 7001, payload: []byte("big")}, false, snat6, 2, 0, false, 0},
		{"v6 UDP port unreachable from the pod", flow{src: pod6, dst: remote6, proto: protoUDP, sport: 42001, dport: 7001, payload: []byte("q")}, false, pod6, 1, 4, true, 0},
		{"v6 TCP packet too big from a node address", flow{src: pod6, dst: remote6, proto: protoTCP, sport: 42002, dport: 443, payload: []byte("data")}, false, nodeLocal6, 2, 0, false, 0},
		{"v6 echo reply unreachable from the pod", flow{src: pod6, dst: remote6, proto: protoICMPv6, icmpType: 128, sport: 4243, payload: []byte("p")}, false, pod6, 1, 4, true, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			snat := snat4
			if c.f.src.Is6() {
				snat = snat6
			}
			// The pod's packet goes out; the remote answers to the NAT view.
			var natPort uint16
			var remoteSent, podGot []byte
			if c.sctp {
				checkSCTP(t, e.egress(sctpPacket(c.f.src, c.f.dst, c.f.sport, c.f.dport)))
				natPort = c.f.sport
				remoteSent = sctpPacket(c.f.dst, snat, c.f.dport, natPort)[14:]
				podGot = sctpPacket(c.f.dst, c.f.src, c.f.dport, c.f.sport)[14:]
			} else {
				natPort = masqueraded(t, e.egress(c.f.packet()), c.f, snat)
				r := reply(c.f, snat, natPort)
				r.tcpFlags = tcpACK
				remoteSent = r.packet()[14:]
				podGot = e.ingress(r.packet())[14:]
				want := c.f
				want.src, want.dst, want.sport, want.dport = c.f.dst, c.f.src, c.f.dport, c.f.sport
				if c.f.proto == protoICMP || c.f.proto == protoICMPv6 {
					want = r
					want.dst = c.f.src
					want.sport = c.f.sport
				}
				want.tcpFlags = tcpACK
				if !bytes.Equal(podGot, want.packet()[14:]) {
					t.Fatalf("reply to the pod:\n got %x\nwant %x", podGot, want.packet()[14:])
				}
			}
			quote, wantQuote := podGot, remoteSent
			if c.truncateTo > 0 {
				quote, wantQuote = quote[:c.truncateTo], wantQuote[:c.truncateTo]
			}
			outerSrc := c.from
			if c.fromPod {
				outerSrc = snat
			}
			before := e.counters()
			out := e.egress(icmpError(c.from, c.f.dst, c.typ, c.code, quote))
			if c.truncateTo > 0 {
				// The quoted TCP checksum was cut off: only the rest is
				// compared, and the ICMP checksum is checked on its own.
				p := parse(t, out)
				if p.src != outerSrc || !bytes.Equal(p.l4[8:], wantQuote) {
					t.Fatalf("error from %v quoting\n %x\nwant from %v quoting\n %x", p.src, p.l4[8:], outerSrc, wantQuote)
				}
			} else if want := icmpError(outerSrc, c.f.dst, c.typ, c.code, wantQuote); !bytes.Equal(out, want) {
				t.Fatalf("ICMP error on egress:\n got %x\nwant %x", out, want)
			}
			e.checkCounters(before, map[Counter]uint64{CounterICMPErrorEgress: 1})
		})
	}

	t.Run("a pod's error about no translated flow is dropped", func(t *testing.T) {
		stray := flow{src: remote4, dst: pod1, proto: protoUDP, sport: 7001, dport: 50000, payload: []byte("?")}
		before := e.counters()
		if ret, _ := e.run(e.dp.Egress, icmpError(pod1, remote4, 3, 3, stray.packet()[14:])); ret != tcActShot {
			t.Fatalf("verdict %d, want TC_ACT_SHOT", int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterICMPErrorUnknown: 1})
	})
	t.Run("the node's error about no translated flow passes", func(t *testing.T) {
		stray := flow{src: remote4, dst: host, proto: protoUDP, sport: 7001, dport: 50000, payload: []byte("?")}
		in := icmpError(host, remote4, 3, 3, stray.packet()[14:])
		before := e.counters()
		if out := e.egress(in); !bytes.Equal(out, in) {
			t.Fatal("the node's own ICMP error was modified")
		}
		e.checkCounters(before, map[Counter]uint64{CounterSkipNotSource: 1})
	})
	t.Run("a pod's error to a non-masquerade destination passes", func(t *testing.T) {
		dst := netip.MustParseAddr("192.168.1.1")
		stray := flow{src: dst, dst: pod1, proto: protoUDP, sport: 7001, dport: 50000, payload: []byte("?")}
		in := icmpError(pod1, dst, 3, 3, stray.packet()[14:])
		before := e.counters()
		if out := e.egress(in); !bytes.Equal(out, in) {
			t.Fatal("modified")
		}
		e.checkCounters(before, map[Counter]uint64{CounterSkipNonMasqDst: 1})
	})
}

// TestUnparseableIsDropped: an IPv6 header chain longer than the program
// walks cannot be translated; from a pod to a masqueraded destination it is
// dropped, not sent with the pod's address.
func TestUnparseableIsDropped(t *testing.T) {
	e := newEnv(t, envOptions{})
	build := func(src, dst netip.Addr) []byte {
		var ext []byte
		for i := 0; i < 5; i++ {
			next := byte(60) // destination options
			if i == 4 {
				next = protoUDP
			}
			ext = append(ext, next, 0, 1, 4, 0, 0, 0, 0) // PadN option
		}
		f := flow{src: src, dst: dst, proto: protoUDP, sport: 1, dport: 2}
		ip := ipPacket(src, dst, 60, 0, 0, append(ext, f.l4()...))
		return ether(ip)
	}
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, build(pod6, remote6)); ret != tcActShot {
		t.Fatalf("verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterDropUntranslatable: 1})
	in := build(pod6, netip.MustParseAddr("fd00:20::1"))
	if out := e.egress(in); !bytes.Equal(out, in) {
		t.Fatal("a packet to a non-masquerade destination was modified")
	}
}

// TestICMPErrorOnIngressForFixedPairs: an error about an SCTP or
// address-only flow (a router's "unreachable" quoting the translated
// packet) reaches the pod with the quote in the pod's view.
func TestICMPErrorOnIngressForFixedPairs(t *testing.T) {
	e := newEnv(t, envOptions{})
	cases := []struct {
		name         string
		pod, snat    netip.Addr
		remote, from netip.Addr
		typ, code    uint8
		packet       func(src, dst netip.Addr) []byte
	}{
		{"SCTP v4", pod1, snat4, remote4, router4, 3, 1, func(s, d netip.Addr) []byte { return sctpPacket(s, d, 5100, 38412) }},
		{"GRE v4", pod1, snat4, remote4, router4, 3, 1, func(s, d netip.Addr) []byte { return opaque(s, d, protoGRE) }},
		{"ESP v6", pod6, snat6, remote6, router6, 1, 3, func(s, d netip.Addr) []byte { return opaque(s, d, protoESP) }},
		{"SCTP v6", pod6, snat6, remote6, router6, 1, 3, func(s, d netip.Addr) []byte { return sctpPacket(s, d, 5100, 38412) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sent := e.egress(c.packet(c.pod, c.remote))
			if want := c.packet(c.snat, c.remote); !bytes.Equal(sent, want) {
				t.Fatalf("egress:\n got %x\nwant %x", sent, want)
			}
			before := e.counters()
			got := e.ingress(icmpError(c.from, c.snat, c.typ, c.code, sent[14:]))
			if want := icmpError(c.from, c.pod, c.typ, c.code, c.packet(c.pod, c.remote)[14:]); !bytes.Equal(got, want) {
				t.Fatalf("ICMP error to the pod:\n got %x\nwant %x", got, want)
			}
			e.checkCounters(before, map[Counter]uint64{CounterICMPErrorReverse: 1})
		})
	}
}

// BenchmarkNewPaths reports the per-packet cost of the paths added for
// L3 devices and all protocols as ratios to an established TCP flow's
// egress, measured in the same run, interleaved in rounds (median of the
// per-round ratios): an established address-only (GRE) flow, and an ICMP
// error the node sends about a translated UDP flow (quote rewritten).
func BenchmarkNewPaths(b *testing.B) {
	e := newEnv(b, envOptions{})
	tcp := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpACK, payload: make([]byte, 1400)}
	pingPong(b, e, tcp) // the SNAT address is now a masquerade source too

	// GRE: the output (from the SNAT address) maps back to the pod.
	gre := opaque(pod1, remote4, protoGRE)
	e.egress(gre)
	if err := e.dp.Maps.NatV4.Put(NATKeyV4{Src: Addr4(snat4), Dst: Addr4(remote4), Proto: protoGRE, Dir: DirEgress},
		NATValV4{Addr: Addr4(pod1)}); err != nil {
		b.Fatal(err)
	}

	// The node's "fragmentation needed" about the remote's UDP answer to the
	// pod: translated, its quote is remote -> SNAT:NAT port, which an extra
	// dir-0 entry maps back to the pod's view.
	udp := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 42000, dport: 7001, payload: []byte("q")}
	natPort := masqueradedB(b, e, udp)
	if err := e.dp.Maps.NatV4.Put(NATKeyV4{Src: Addr4(snat4), Dst: Addr4(remote4), Sport: Port(natPort), Dport: Port(7001), Proto: protoUDP, Dir: DirEgress},
		NATValV4{Addr: Addr4(pod1), Port: Port(42000)}); err != nil {
		b.Fatal(err)
	}
	quote := e.ingress(reply(udp, snat4, natPort).packet())[14:]
	icmpErr := icmpError(host, remote4, 3, 4, quote)

	const rounds, perRound = 7, 20000
	perPkt := func(frame []byte) float64 {
		ret, d, err := e.dp.Egress.Benchmark(frame, perRound, nil)
		if err != nil || ret != tcActUnspec {
			b.Fatalf("verdict %d, %v", int32(ret), err)
		}
		return float64(d.Nanoseconds())
	}
	var greRatio, icmpRatio []float64
	var base []float64
	for range b.N {
		for range rounds {
			t := perPkt(tcp.packet())
			base = append(base, t)
			greRatio = append(greRatio, perPkt(gre)/t)
			icmpRatio = append(icmpRatio, perPkt(icmpErr)/t)
		}
	}
	b.ReportMetric(median(base), "tcp-ns/pkt")
	b.ReportMetric(median(greRatio), "gre/tcp")
	b.ReportMetric(median(icmpRatio), "icmp-error/tcp")
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// sctpChunkPacket is sctpPacket with one chunk of type chunk (no body).
func sctpChunkPacket(src, dst netip.Addr, sport, dport uint16, chunk byte) []byte {
	b := make([]byte, 12, 16)
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	binary.BigEndian.PutUint32(b[4:], 0xdecafbad)
	b = append(b, chunk, 0, 0, 4)
	binary.LittleEndian.PutUint32(b[8:], crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)))
	return ether(ipPacket(src, dst, protoSCTP, 1, 0, b))
}

// SCTP chunk types (RFC 9260).
const (
	sctpInit         = 1
	sctpInitAck      = 2
	sctpHeartbeatAck = 5
	sctpAbort        = 6
	sctpShutdown     = 7
	sctpCookieEcho   = 10
	sctpCookieAck    = 11
)

// replyFlags reads the flags of the reply (dir 1) entry of the fixed pair
// of pod to remote.
func (e *testEnv) replyFlags(t *testing.T, proto uint8, remote netip.Addr, sport, dport uint16) uint8 {
	t.Helper()
	if remote.Is6() {
		k := NATKeyV6{Src: remote.As16(), Dst: snat6.As16(), Sport: Port(dport), Dport: Port(sport), Proto: proto, Dir: DirIngress}
		var v NATValV6
		if err := e.dp.Maps.NatV6.Lookup(k, &v); err != nil {
			t.Fatalf("reply entry of the %d pair: %v", proto, err)
		}
		return v.Flags
	}
	k := NATKeyV4{Src: Addr4(remote), Dst: Addr4(snat4), Sport: Port(dport), Dport: Port(sport), Proto: proto, Dir: DirIngress}
	var v NATValV4
	if err := e.dp.Maps.NatV4.Lookup(k, &v); err != nil {
		t.Fatalf("reply entry of the %d pair: %v", proto, err)
	}
	return v.Flags
}

// TestFixedPairsAssuredAsLinux: SCTP and GRE pairs are assured as
// conntrack assures them, so a full table spares them: an SCTP association
// once the remote's COOKIE-ACK (or, on another path, HEARTBEAT-ACK)
// completes it, not on its INIT-ACK, and again evictable once a SHUTDOWN
// or ABORT ends it (sctp_can_early_drop); a GRE pair on the remote's
// answer. ESP and other protocols stay evictable: conntrack tracks them as
// generic, never assured. Both families.
func TestFixedPairsAssuredAsLinux(t *testing.T) {
	e := newEnv(t, envOptions{})
	for _, c := range []struct{ pod, remote, snat netip.Addr }{{pod1, remote4, snat4}, {pod6, remote6, snat6}} {
		assured := func(proto uint8, sport, dport uint16) bool {
			return e.replyFlags(t, proto, c.remote, sport, dport)&NATFlagSeen != 0
		}
		e.egress(sctpChunkPacket(c.pod, c.remote, 5000, 38412, sctpInit))
		e.ingress(sctpChunkPacket(c.remote, c.snat, 38412, 5000, sctpInitAck))
		if assured(protoSCTP, 5000, 38412) {
			t.Fatalf("%v: SCTP assured by the INIT-ACK", c.remote)
		}
		e.egress(sctpChunkPacket(c.pod, c.remote, 5000, 38412, sctpCookieEcho))
		e.ingress(sctpChunkPacket(c.remote, c.snat, 38412, 5000, sctpCookieAck))
		if !assured(protoSCTP, 5000, 38412) {
			t.Fatalf("%v: SCTP not assured by the COOKIE-ACK", c.remote)
		}
		e.egress(sctpChunkPacket(c.pod, c.remote, 5000, 38412, sctpShutdown))
		if assured(protoSCTP, 5000, 38412) {
			t.Fatalf("%v: SCTP still assured after the pod's SHUTDOWN", c.remote)
		}
		// Another path of an association: HEARTBEAT, HEARTBEAT-ACK.
		e.egress(sctpChunkPacket(c.pod, c.remote, 5001, 38412, 4))
		e.ingress(sctpChunkPacket(c.remote, c.snat, 38412, 5001, sctpHeartbeatAck))
		if !assured(protoSCTP, 5001, 38412) {
			t.Fatalf("%v: SCTP path not assured by the HEARTBEAT-ACK", c.remote)
		}
		e.ingress(sctpChunkPacket(c.remote, c.snat, 38412, 5001, sctpAbort))
		if assured(protoSCTP, 5001, 38412) {
			t.Fatalf("%v: SCTP still assured after the remote's ABORT", c.remote)
		}

		for _, proto := range []uint8{protoGRE, protoESP} {
			e.egress(opaque(c.pod, c.remote, proto))
			if assured(proto, 0, 0) {
				t.Fatalf("%v: protocol %d assured before an answer", c.remote, proto)
			}
			e.ingress(opaque(c.remote, c.snat, proto))
			if got, want := assured(proto, 0, 0), proto == protoGRE; got != want {
				t.Fatalf("%v: protocol %d answered: assured %v, want %v", c.remote, proto, got, want)
			}
		}
	}
}

// TestFullTableSparesAssuredFixedPairs: a table full of an answered GRE
// pair, an established SCTP association and an answered ESP pair (with
// TCP pairs established around them) admits a new flow by dropping the
// ESP pair, which conntrack never assures, and then refuses the next one:
// the GRE and SCTP pairs stay. A new SCTP or GRE flow meeting a full table
// of droppable pairs early-drops one for itself, as a TCP or UDP flow
// does (it was refused).
func TestFullTableSparesAssuredFixedPairs(t *testing.T) {
	const natMax = 8 // 4 pairs
	e := newEnv(t, envOptions{natMax: natMax})
	e.egress(sctpChunkPacket(pod1, remote4, 5000, 38412, sctpCookieEcho))
	e.ingress(sctpChunkPacket(remote4, snat4, 38412, 5000, sctpCookieAck))
	for _, proto := range []uint8{protoGRE, protoESP} {
		e.egress(opaque(pod1, remote4, proto))
		e.ingress(opaque(remote4, snat4, proto))
	}
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	port := masqueraded(t, e.egress(f.packet()), f, snat4)
	e.ingress(reply(f, snat4, port).packet())

	g := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40001, dport: 443, tcpFlags: tcpSYN}
	before := e.counters()
	masqueraded(t, e.egress(g.packet()), g, snat4)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATEarlyDrop: 1})
	if out := e.egress(opaque(pod1, remote4, protoGRE)); !bytes.Equal(out, opaque(snat4, remote4, protoGRE)) {
		t.Fatal("the assured GRE pair was dropped")
	}
	if out := checkSCTP(t, e.egress(sctpChunkPacket(pod1, remote4, 5000, 38412, 0))); out.src != snat4 {
		t.Fatal("the assured SCTP pair was dropped")
	}
	e.ingress(reply(g, snat4, parse(t, e.egress(g.packet())).sport).packet())
	time.Sleep(150 * time.Millisecond) // past the search backoff
	h := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40002, dport: 443, tcpFlags: tcpSYN}
	before = e.counters()
	if ret, _ := e.run(e.dp.Egress, h.packet()); ret != tcActShot {
		t.Fatalf("new flow with only assured pairs: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNATFull: 1})

	// A table of droppable pairs (unanswered UDP queries) admits new SCTP
	// and GRE flows.
	e2 := newEnv(t, envOptions{natMax: natMax})
	udpQueries(t, e2, 50000, natMax/2, false)
	before = e2.counters()
	if out := checkSCTP(t, e2.egress(sctpChunkPacket(pod1, remote4, 5000, 38412, sctpInit))); out.src != snat4 {
		t.Fatalf("new SCTP flow in a full table sent from %v", out.src)
	}
	e2.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATNewSCTP: 1, CounterNATEarlyDrop: 1})
	time.Sleep(150 * time.Millisecond)
	before = e2.counters()
	if out := e2.egress(opaque(pod1, remote4, protoGRE)); !bytes.Equal(out, opaque(snat4, remote4, protoGRE)) {
		t.Fatal("new GRE flow in a full table not translated")
	}
	e2.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATNewAddrOnly: 1, CounterNATEarlyDrop: 1})
}
