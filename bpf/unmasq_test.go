package bpf

import (
	"bytes"
	"errors"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// The decision of a flow that started unmasqueraded is kept for its life
// (lib/unmasq.h): these tests change the non-masquerade tries under running
// flows, as a config change does.

var (
	// unmasqDst4/6 are inside newEnv's non-masquerade ranges until a test
	// masquerades them with a /32 (/128) exception.
	unmasqDst4 = netip.MustParseAddr("192.168.1.1")
	unmasqDst6 = netip.MustParseAddr("fd00:20::1")
)

// setDecision writes dst's own entry into the family's trie: masquerade or
// not, as a config change would.
func (e *testEnv) setDecision(dst netip.Addr, masquerade bool) {
	e.tb.Helper()
	action := uint8(0)
	if masquerade {
		action = 1
	}
	var err error
	if dst.Is4() {
		err = e.dp.Maps.NonmasqV4.Put(LPMKeyV4From(netip.PrefixFrom(dst, 32)), action)
	} else {
		err = e.dp.Maps.NonmasqV6.Put(LPMKeyV6From(netip.PrefixFrom(dst, 128)), action)
	}
	if err != nil {
		e.tb.Fatal(err)
	}
}

// unmasqRecord returns the record of f's egress tuple, if there is one.
func (e *testEnv) unmasqRecord(f flow) (UnmasqVal, bool) {
	e.tb.Helper()
	var v UnmasqVal
	var err error
	if f.src.Is4() {
		k := NATKeyV4{Src: Addr4(f.src), Dst: Addr4(f.dst), Sport: Port(f.sport), Dport: Port(f.dport), Proto: f.proto, Dir: DirEgress}
		err = e.dp.Maps.UnmasqV4.Lookup(k, &v)
	} else {
		k := NATKeyV6{Src: f.src.As16(), Dst: f.dst.As16(), Sport: Port(f.sport), Dport: Port(f.dport), Proto: f.proto, Dir: DirEgress}
		err = e.dp.Maps.UnmasqV6.Lookup(k, &v)
	}
	return v, err == nil
}

// putUnmasqRecord overwrites the record of f's egress tuple.
func (e *testEnv) putUnmasqRecord(f flow, v UnmasqVal) {
	e.tb.Helper()
	var err error
	if f.src.Is4() {
		k := NATKeyV4{Src: Addr4(f.src), Dst: Addr4(f.dst), Sport: Port(f.sport), Dport: Port(f.dport), Proto: f.proto, Dir: DirEgress}
		err = e.dp.Maps.UnmasqV4.Put(k, v)
	} else {
		k := NATKeyV6{Src: f.src.As16(), Dst: f.dst.As16(), Sport: Port(f.sport), Dport: Port(f.dport), Proto: f.proto, Dir: DirEgress}
		err = e.dp.Maps.UnmasqV6.Put(k, v)
	}
	if err != nil {
		e.tb.Fatal(err)
	}
}

func snatOf(a netip.Addr) netip.Addr {
	if a.Is4() {
		return snat4
	}
	return snat6
}

// unmasqFlows are one flow per protocol and family toward unmasqDst4/6;
// TCP flows start with a SYN (tcpFlags 0).
func unmasqFlows() []flow {
	var fs []flow
	for _, d := range []struct {
		src, dst netip.Addr
		icmp     uint8
		echo     uint8
	}{{pod1, unmasqDst4, protoICMP, 8}, {pod6, unmasqDst6, protoICMPv6, 128}} {
		fs = append(fs,
			flow{src: d.src, dst: d.dst, proto: protoUDP, sport: 40000, dport: 514, payload: []byte("syslog")},
			flow{src: d.src, dst: d.dst, proto: protoTCP, sport: 40001, dport: 443},
			flow{src: d.src, dst: d.dst, proto: d.icmp, icmpType: d.echo, sport: 4242, payload: []byte("ping")},
		)
	}
	return fs
}

// TestUnmasqueradedFlowKeepsDecision: a flow that started toward a
// non-masquerade destination keeps its source after that destination is
// masqueraded (UDP, TCP, ICMP echo, both families); a new flow to it is
// masqueraded.
func TestUnmasqueradedFlowKeepsDecision(t *testing.T) {
	e := newEnv(t, envOptions{})
	fs := unmasqFlows()
	for _, f := range fs {
		before := e.counters()
		unchanged(t, f.packet(), e.egress(f.packet()))
		e.checkCounters(before, map[Counter]uint64{CounterSkipNonMasqDst: 1, CounterUnmasqNew: 1})
		if _, ok := e.unmasqRecord(f); !ok {
			t.Fatalf("%v %v -> %v: no record", f.proto, f.src, f.dst)
		}
		if f.proto == protoTCP {
			// the handshake's ACK
			f.tcpFlags = tcpACK
			unchanged(t, f.packet(), e.egress(f.packet()))
		}
	}
	// Readers see them through the pins: one record per flow.
	fill, err := (Pinned{Dir: e.pinDir}).UnmasqFill()
	if err != nil {
		t.Fatal(err)
	}
	want := []NATMapFill{
		{Family: "ipv4", Entries: 3, Capacity: int(UnmasqEntries(DefaultNATMaxEntries))},
		{Family: "ipv6", Entries: 3, Capacity: int(UnmasqEntries(DefaultNATMaxEntries))},
	}
	if !slices.Equal(fill, want) {
		t.Fatalf("UnmasqFill = %+v, want %+v", fill, want)
	}

	e.setDecision(unmasqDst4, true)
	e.setDecision(unmasqDst6, true)
	for _, f := range fs {
		if f.proto == protoTCP {
			f.tcpFlags = tcpACK | 0x08 // PSH: data
		}
		for range 3 {
			before := e.counters()
			unchanged(t, f.packet(), e.egress(f.packet()))
			e.checkCounters(before, map[Counter]uint64{CounterSkipNonMasqDst: 1})
		}
		// A new flow of the source to the same destination.
		n := f
		n.sport++
		n.tcpFlags = 0
		masqueraded(t, e.egress(n.packet()), n, snatOf(n.src))
	}
}

// TestMasqueradedFlowKeepsDecision: a masqueraded flow keeps its NAT pair
// after its destination becomes a non-masquerade one; a new flow to it is
// left alone (and recorded).
func TestMasqueradedFlowKeepsDecision(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setDecision(unmasqDst4, true)
	e.setDecision(unmasqDst6, true)
	fs := unmasqFlows()
	ports := make([]uint16, len(fs))
	for i, f := range fs {
		ports[i] = masqueraded(t, e.egress(f.packet()), f, snatOf(f.src))
	}
	e.setDecision(unmasqDst4, false)
	e.setDecision(unmasqDst6, false)
	for i, f := range fs {
		if f.proto == protoTCP {
			f.tcpFlags = tcpACK
		}
		if p := masqueraded(t, e.egress(f.packet()), f, snatOf(f.src)); p != ports[i] {
			t.Fatalf("%v %v: NAT port %d, was %d", f.proto, f.src, p, ports[i])
		}
		if _, ok := e.unmasqRecord(f); ok {
			t.Fatalf("%v %v: a masqueraded flow has an unmasqueraded record", f.proto, f.src)
		}
		n := f
		n.sport++
		n.tcpFlags = 0
		before := e.counters()
		unchanged(t, n.packet(), e.egress(n.packet()))
		e.checkCounters(before, map[Counter]uint64{CounterSkipNonMasqDst: 1, CounterUnmasqNew: 1})
	}
}

// TestUnmasqRecordLifetime: the record follows the flow's state as the
// source's side shows it, a closed TCP record does not keep a new
// connection of its tuple, and an expired record is deleted and the
// packet decided again.
func TestUnmasqRecordLifetime(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: unmasqDst4, proto: protoTCP, sport: 40000, dport: 443}
	states := []struct {
		flags uint8
		want  NATState
	}{
		{0, StateTCPSyn},
		{tcpACK, StateTCPEstablished},
		{tcpFIN | tcpACK, StateTCPClosing},
	}
	for _, s := range states {
		f.tcpFlags = s.flags
		unchanged(t, f.packet(), e.egress(f.packet()))
		v, ok := e.unmasqRecord(f)
		if !ok {
			t.Fatalf("flags %#x: no record", s.flags)
		}
		if got := StateOf(protoTCP, v.Flags); got != s.want {
			t.Fatalf("flags %#x: record in state %s, want %s", s.flags, got, s.want)
		}
	}
	e.setDecision(unmasqDst4, true)
	// The last ACK of the closed connection still passes as it is.
	f.tcpFlags = tcpACK
	unchanged(t, f.packet(), e.egress(f.packet()))
	// A new connection of the tuple is a new flow: decided by the config.
	f.tcpFlags = 0
	masqueraded(t, e.egress(f.packet()), f, snat4)
	if _, ok := e.unmasqRecord(f); ok {
		t.Fatal("the closed record outlived the new connection's SYN")
	}

	// An expired record (a UDP flow idle for longer than 30 s: stamped
	// at boot) keeps nothing.
	u := flow{src: pod6, dst: unmasqDst6, proto: protoUDP, sport: 40000, dport: 514}
	unchanged(t, u.packet(), e.egress(u.packet()))
	e.setDecision(unmasqDst6, true)
	unchanged(t, u.packet(), e.egress(u.packet()))
	v, _ := e.unmasqRecord(u)
	v.LastSeenNs = 0
	e.putUnmasqRecord(u, v)
	masqueraded(t, e.egress(u.packet()), u, snat6)
	if _, ok := e.unmasqRecord(u); ok {
		t.Fatal("the expired record was not deleted")
	}
}

// TestUnmasqRecordsOnlyFlows: a RST or SYN-ACK without a pair starts no
// record, and neither does a node address destination (not the config's
// decision).
func TestUnmasqRecordsOnlyFlows(t *testing.T) {
	e := newEnv(t, envOptions{})
	for _, flags := range []uint8{tcpRST, tcpRST | tcpACK, tcpSYN | tcpACK} {
		f := flow{src: pod1, dst: unmasqDst4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: flags}
		unchanged(t, f.packet(), e.egress(f.packet()))
		if _, ok := e.unmasqRecord(f); ok {
			t.Fatalf("flags %#x: recorded", flags)
		}
	}
	f := flow{src: pod1, dst: host, proto: protoUDP, sport: 40000, dport: 53}
	unchanged(t, f.packet(), e.egress(f.packet()))
	if _, ok := e.unmasqRecord(f); ok {
		t.Fatal("a flow to a node address was recorded")
	}
}

// TestUnmasqueradedFlowKeepsFragments: a fragmented datagram of a flow kept
// unmasqueraded after its destination was masqueraded leaves whole and
// untranslated, its later fragment included (not dropped as a fragment
// whose first was not seen).
func TestUnmasqueradedFlowKeepsFragments(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: unmasqDst4, proto: protoUDP, sport: 6000, dport: 514, payload: []byte("first")}
	unchanged(t, f.packet(), e.egress(f.packet()))
	e.setDecision(unmasqDst4, true)

	// A UDP datagram of 8+24 bytes split after 16 bytes of UDP.
	f.payload, f.ipID = bytes.Repeat([]byte("x"), 24), 0x4242
	l4 := f.l4()
	first := ether(ipPacket(f.src, f.dst, protoUDP, f.ipID, 0x2000, l4[:16]))
	second := ether(ipPacket(f.src, f.dst, protoUDP, f.ipID, 16/8, l4[16:]))
	before := e.counters()
	unchanged(t, first, e.egress(first))
	unchanged(t, second, e.egress(second))
	e.checkCounters(before, map[Counter]uint64{CounterSkipNonMasqDst: 2})

	// Another datagram's orphan fragment to the destination is still
	// dropped: it may be a masqueraded flow's.
	orphan := ether(ipPacket(f.src, f.dst, protoUDP, 0x4343, 16/8, l4[16:]))
	if ret, _ := e.run(e.dp.Egress, orphan); ret != tcActShot {
		t.Fatalf("orphan fragment verdict %d, want TC_ACT_SHOT", int32(ret))
	}
}

// TestReopeningSYNDecidedAgain: a masqueraded TCP flow closes; the config
// then no longer masquerades its destination; a new SYN of the same tuple
// is a new flow (conntrack replaces the closed entry and decides again):
// it leaves untranslated, is recorded as unmasqueraded, its next segment
// is untranslated too, and the closed pair is gone. While the destination
// is still masqueraded, the same SYN reopens the pair with its port.
func TestReopeningSYNDecidedAgain(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setDecision(unmasqDst4, true)
	f := flow{src: pod1, dst: unmasqDst4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	closeFlow := func(port uint16) {
		t.Helper()
		f.tcpFlags = tcpFIN | tcpACK
		masqueraded(t, e.egress(f.packet()), f, snat4)
		r := reply(f, snat4, port)
		r.tcpFlags = tcpFIN | tcpACK
		e.ingress(r.packet())
		f.tcpFlags = tcpSYN
	}
	port := masqueraded(t, e.egress(f.packet()), f, snat4)
	e.ingress(reply(f, snat4, port).packet())
	closeFlow(port)
	before := e.counters()
	if got := masqueraded(t, e.egress(f.packet()), f, snat4); got != port {
		t.Fatalf("reopened with port %d, was %d", got, port)
	}
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATReopened: 1})
	closeFlow(port)

	e.setDecision(unmasqDst4, false)
	before = e.counters()
	unchanged(t, f.packet(), e.egress(f.packet()))
	e.checkCounters(before, map[Counter]uint64{CounterSkipNonMasqDst: 1, CounterUnmasqNew: 1})
	f.tcpFlags = tcpACK
	unchanged(t, f.packet(), e.egress(f.packet()))
	k := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(unmasqDst4), Sport: Port(40000), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
	var v NATValV4
	if err := e.dp.Maps.NatV4.Lookup(k, &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Fatalf("the closed pair outlived the new flow of its tuple: %v", err)
	}
	if n := e.natCount(false); n[DirIngress] != 0 {
		t.Fatalf("%d reply entries left, want none", n[DirIngress])
	}
}

// TestCompatCoarseClock: where the kernel has bpf_ktime_get_coarse_ns
// (5.11), the compat variant stamps its records with it, as the full
// variant does (lib/compat.h: compat_coarse_clock, set by Load after a
// probe): each record's stamp lies between two reads of
// CLOCK_MONOTONIC_COARSE around its packet. The full-resolution clock runs
// ahead of the coarse one between two ticks, so a record it stamped is
// later than the second read unless a tick fell in between, and of several
// flows' records not all are. Where the kernel has no such helper (5.10)
// the verifier drops the call and the records keep bpf_ktime_get_ns: each
// stamp then lies between two reads of CLOCK_MONOTONIC.
func TestCompatCoarseClock(t *testing.T) {
	clock, name := int32(unix.CLOCK_MONOTONIC_COARSE), "coarse"
	if !hasCoarseClock() {
		clock, name = unix.CLOCK_MONOTONIC, "full-resolution"
	}
	e := newEnv(t, envOptions{variant: VariantCompat})
	coarse := func() uint64 {
		var ts unix.Timespec
		if err := unix.ClockGettime(clock, &ts); err != nil {
			t.Fatal(err)
		}
		return uint64(ts.Nano())
	}
	for i := range 5 {
		f := flow{src: pod1, dst: unmasqDst4, proto: protoTCP, sport: uint16(40000 + i), dport: 443, tcpFlags: tcpSYN}
		before := coarse()
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActUnspec {
			t.Fatalf("flow %d: verdict %d", i, int32(ret))
		}
		after := coarse()
		u, ok := e.unmasqRecord(f)
		if !ok {
			t.Fatalf("flow %d: no record", i)
		}
		if u.LastSeenNs < before || u.LastSeenNs > after {
			t.Errorf("flow %d: record stamped %d, want the %s clock's, between %d and %d", i, u.LastSeenNs, name, before, after)
		}
	}
}
