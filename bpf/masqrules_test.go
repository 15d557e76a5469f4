package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
)

// User masquerade rules: sources that are not pods (WireGuard clients),
// masqueraded when they leave through a given device.

var (
	client4  = netip.MustParseAddr("192.168.6.1") // not a pod source
	clients4 = netip.MustParsePrefix("192.168.6.0/24")
	ruleTo4  = netip.MustParseAddr("198.51.100.50")
	client6  = netip.MustParseAddr("fd00:6::1")
	clients6 = netip.MustParsePrefix("fd00:6::/64")
	ruleTo6  = netip.MustParseAddr("2001:db8:6::1")

	otherIfindex = 2 // a device the test packets do not leave through
)

// The masquerade sources of every test environment (newEnv).
var (
	podSources4 = netip.MustParsePrefix("10.0.0.0/16")
	podSources6 = netip.MustParsePrefix("fd00:10::/64")
)

// putMasqRule writes the rule for the sources in src leaving through
// ifindex into the map of src's family, with the key and value the agent
// writes (reconcilers/masqrules, from the config's checked rules).
func putMasqRule(dp *Datapath, ifindex int, src netip.Prefix, to netip.Addr) error {
	if src.Addr().Is4() {
		return dp.Maps.MasqRulesV4.Put(MasqRuleKeyV4From(ifindex, src), MasqRuleTo(to))
	}
	return dp.Maps.MasqRulesV6.Put(MasqRuleKeyV6From(ifindex, src), MasqRuleTo(to))
}

// deleteMasqRule removes the rule for src on ifindex; the error wraps
// ebpf.ErrKeyNotExist if there is none.
func deleteMasqRule(dp *Datapath, ifindex int, src netip.Prefix) error {
	if src.Addr().Is4() {
		return dp.Maps.MasqRulesV4.Delete(MasqRuleKeyV4From(ifindex, src))
	}
	return dp.Maps.MasqRulesV6.Delete(MasqRuleKeyV6From(ifindex, src))
}

// setRule sets a rule and, as the agent does, flags its source and every
// masq_src entry it covers with MasqSrcRules (an entry the source lies in
// lends it MasqSrcMasquerade).
func (e *testEnv) setRule(ifindex int, src netip.Prefix, to netip.Addr) {
	e.tb.Helper()
	if err := putMasqRule(e.dp, ifindex, src, to); err != nil {
		e.tb.Fatal(err)
	}
	var err error
	for _, pod := range []netip.Prefix{podSources4, podSources6} {
		if pod.Addr().Is4() != src.Addr().Is4() {
			continue
		}
		flags := MasqSrcRules
		if pod.Bits() <= src.Bits() && pod.Contains(src.Addr()) {
			flags |= MasqSrcMasquerade
		}
		covers := src.Bits() <= pod.Bits() && src.Contains(pod.Addr())
		if src.Addr().Is4() {
			err = errors.Join(err, e.dp.Maps.MasqSrcV4.Put(LPMKeyV4From(src), flags))
			if covers {
				err = errors.Join(err, e.dp.Maps.MasqSrcV4.Put(LPMKeyV4From(pod), MasqSrcMasquerade|MasqSrcRules))
			}
		} else {
			err = errors.Join(err, e.dp.Maps.MasqSrcV6.Put(LPMKeyV6From(src), flags))
			if covers {
				err = errors.Join(err, e.dp.Maps.MasqSrcV6.Put(LPMKeyV6From(pod), MasqSrcMasquerade|MasqSrcRules))
			}
		}
	}
	if err != nil {
		e.tb.Fatal(err)
	}
}

// ruleFlow sends the first packet of f and its reply: f must be translated
// to snat by a rule (one new pair) and the reply back to f's source.
func ruleFlow(t *testing.T, e *testEnv, f flow, snat netip.Addr) uint16 {
	t.Helper()
	before := e.counters()
	natPort := masqueraded(t, e.egress(f.packet()), f, snat)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATNewByRule: 1})

	before = e.counters()
	p := parse(t, e.ingress(reply(f, snat, natPort).packet()))
	want := parsed{src: f.dst, dst: f.src, sport: f.dport, dport: f.sport}
	if f.proto == protoICMP || f.proto == protoICMPv6 {
		want.sport, want.dport = f.sport, 0 // the echo identifier
	}
	if p.src != want.src || p.dst != want.dst || p.sport != want.sport || p.dport != want.dport {
		t.Fatalf("reply translated to %v:%d -> %v:%d, want %v:%d -> %v:%d",
			p.src, p.sport, p.dst, p.dport, want.src, want.sport, want.dst, want.dport)
	}
	e.checkCounters(before, map[Counter]uint64{CounterReverse: 1})
	return natPort
}

// untouched requires that egress passes f unmodified, counting why.
func untouched(t *testing.T, e *testEnv, f flow, why Counter) {
	t.Helper()
	before := e.counters()
	if in, out := f.packet(), e.egress(f.packet()); !bytes.Equal(in, out) {
		t.Fatalf("packet modified:\n got %x\nwant %x", out, in)
	}
	want := map[Counter]uint64{why: 1}
	if why == CounterSkipNonMasqDst {
		// the flow's first packet: its decision is recorded
		want[CounterUnmasqNew] = 1
	}
	e.checkCounters(before, want)
}

func TestMasqRuleToDeviceAddress(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, clients4, netip.Addr{})
	f := flow{src: client4, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN, payload: []byte("hello")}
	natPort := ruleFlow(t, e, f, snat4)

	// Packets of the established flow count no new pair.
	before := e.counters()
	f.tcpFlags = tcpACK
	if got := masqueraded(t, e.egress(f.packet()), f, snat4); got != natPort {
		t.Fatalf("second packet got NAT port %d, first %d", got, natPort)
	}
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1})

	// ICMP errors about the flow go back to the client too.
	out := e.egress(f.packet())
	res := parse(t, e.ingress(icmpError(router4, snat4, 3, 4, bytes.Clone(out[14:]))))
	if res.dst != client4 {
		t.Fatalf("ICMP error sent to %v, want %v", res.dst, client4)
	}
}

func TestMasqRuleToAddress(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, clients4, ruleTo4)
	f := flow{src: client4, dst: remote4, proto: protoUDP, sport: 5000, dport: 53, payload: []byte("q")}
	natPort := ruleFlow(t, e, f, ruleTo4)

	// The pair records the rule's address: that is what replies match.
	var v NATValV4
	k := NATKeyV4{Src: Addr4(client4), Dst: Addr4(remote4), Sport: Port(5000), Dport: Port(53), Proto: protoUDP, Dir: DirEgress}
	if err := e.dp.Maps.NatV4.Lookup(k, &v); err != nil || AddrFrom4(v.Addr) != ruleTo4 || HostPort(v.Port) != natPort {
		t.Fatalf("egress entry %+v (%v), want %v:%d", v, err, ruleTo4, natPort)
	}

	// A reply to the device's address with that port is not the flow's.
	r := reply(f, snat4, natPort)
	if in, out := r.packet(), e.ingress(r.packet()); !bytes.Equal(in, out) {
		t.Fatal("reply to the device address was translated")
	}

	// The rule's address needs no address of the family on the device.
	if err := e.dp.SetEgressDevice(loIfindex, netip.Addr{}, snat6); err != nil {
		t.Fatal(err)
	}
	f.sport = 5001
	ruleFlow(t, e, f, ruleTo4)
	// A rule without one does: dropped, never sent with the client's address.
	e.setRule(loIfindex, clients4, netip.Addr{})
	f.sport = 5002
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
		t.Fatalf("rule without toAddress, device without IPv4: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterDropNoSNATAddr: 1})
	// And the device must be an egress device at all.
	if err := e.dp.Maps.EgressDevs.Delete(uint32(loIfindex)); err != nil {
		t.Fatal(err)
	}
	e.setRule(loIfindex, clients4, ruleTo4)
	untouched(t, e, f, CounterSkipNoSNATAddr)
}

func TestMasqRuleLongestSourcePrefix(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, netip.MustParsePrefix("192.168.0.0/16"), netip.Addr{})
	e.setRule(loIfindex, clients4, ruleTo4)
	e.setRule(otherIfindex, netip.MustParsePrefix("192.168.6.1/32"), netip.MustParseAddr("198.51.100.99"))

	ruleFlow(t, e, flow{src: client4, dst: remote4, proto: protoUDP, sport: 5000, dport: 53}, ruleTo4)
	ruleFlow(t, e, flow{src: netip.MustParseAddr("192.168.9.1"), dst: remote4, proto: protoUDP, sport: 5000, dport: 53}, snat4)
}

func TestMasqRuleNotApplied(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(otherIfindex, clients4, netip.Addr{})
	e.setRule(otherIfindex, clients6, netip.Addr{})

	t.Run("rule for another device", func(t *testing.T) {
		untouched(t, e, flow{src: client4, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}, CounterSkipNotSource)
		untouched(t, e, flow{src: client6, dst: remote6, proto: protoTCP, sport: 40000, dport: 443}, CounterSkipNotSource)
	})
	t.Run("no rule", func(t *testing.T) {
		e.setRule(loIfindex, clients4, netip.Addr{})
		untouched(t, e, flow{src: netip.MustParseAddr("192.168.5.1"), dst: remote4, proto: protoTCP, sport: 40000, dport: 443}, CounterSkipNotSource)
	})
}

func TestMasqRuleDestinations(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, clients4, netip.Addr{})
	e.setRule(loIfindex, clients6, ruleTo6)

	untouched(t, e, flow{src: client4, dst: netip.MustParseAddr("192.168.1.1"), proto: protoTCP, sport: 40000, dport: 443}, CounterSkipNonMasqDst)
	untouched(t, e, flow{src: client4, dst: host, proto: protoUDP, sport: 40000, dport: 53}, CounterSkipNodeDst)
	untouched(t, e, flow{src: client6, dst: netip.MustParseAddr("fd00:20::1"), proto: protoUDP, sport: 40000, dport: 53}, CounterSkipNonMasqDst)
	// A masqueradeCIDRs exception inside a non-masquerade range.
	ruleFlow(t, e, flow{src: client4, dst: netip.MustParseAddr("192.168.7.7"), proto: protoTCP, sport: 40000, dport: 443}, snat4)
}

func TestMasqRuleV6(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, clients6, netip.Addr{})
	ruleFlow(t, e, flow{src: client6, dst: remote6, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN, payload: []byte("hello")}, snat6)

	e.setRule(loIfindex, clients6, ruleTo6)
	ruleFlow(t, e, flow{src: client6, dst: remote6, proto: protoUDP, sport: 40001, dport: 53, payload: []byte("q")}, ruleTo6)
	ruleFlow(t, e, flow{src: client6, dst: remote6, proto: protoICMPv6, icmpType: 128, sport: 99, payload: []byte("ping")}, ruleTo6)
}

func TestMasqRulePodSources(t *testing.T) {
	e := newEnv(t, envOptions{})
	// A rule that also covers pods applies to them: its toAddress wins over
	// the device's address, as for any other source it names.
	e.setRule(loIfindex, netip.MustParsePrefix("10.0.0.0/8"), ruleTo4)
	ruleFlow(t, e, flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}, ruleTo4)
	// A rule inside the pods' range: the rest of the range stays a
	// masquerade source (to the device's address).
	e = newEnv(t, envOptions{})
	e.setRule(loIfindex, netip.PrefixFrom(pod1, 32), ruleTo4)
	ruleFlow(t, e, flow{src: pod1, dst: remote4, proto: protoUDP, sport: 40000, dport: 53}, ruleTo4)
	f := flow{src: pod2, dst: remote4, proto: protoUDP, sport: 40000, dport: 53}
	before := e.counters()
	masqueraded(t, e.egress(f.packet()), f, snat4)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1})
}

func TestMasqRuleChanges(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, clients4, ruleTo4)
	f := flow{src: client4, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	natPort := ruleFlow(t, e, f, ruleTo4)

	// A new toAddress applies to new flows; established flows keep theirs.
	e.setRule(loIfindex, clients4, netip.Addr{})
	if got := masqueraded(t, e.egress(f.packet()), f, ruleTo4); got != natPort {
		t.Fatalf("NAT port %d after the rule changed, was %d", got, natPort)
	}
	g := f
	g.sport = 40001
	ruleFlow(t, e, g, snat4)

	// A removed rule's running flows keep their translation until they
	// end (Linux keeps a conntrack entry's NAT); new flows of the source
	// are no longer masqueraded.
	if err := deleteMasqRule(e.dp, loIfindex, clients4); err != nil {
		t.Fatal(err)
	}
	for _, flags := range []uint8{tcpACK, tcpSYN} { // mid-stream, and the tuple's SYN again
		f.tcpFlags = flags
		before := e.counters()
		if got := masqueraded(t, e.egress(f.packet()), f, ruleTo4); got != natPort {
			t.Fatalf("NAT port %d after the rule was removed, was %d", got, natPort)
		}
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterFormerSource: 1})
	}
	h := f
	h.sport = 40002
	untouched(t, e, h, CounterSkipNotSource)
	h.tcpFlags = tcpACK
	untouched(t, e, h, CounterSkipNotSource)
	// Once the running flow has closed, a new SYN of its tuple is a new
	// flow: not masqueraded any more, and the closed pair ends, so that
	// the new flow's next segments are not translated by it either (as
	// conntrack replaces the closed entry).
	f.tcpFlags = tcpFIN | tcpACK
	masqueraded(t, e.egress(f.packet()), f, ruleTo4)
	r := reply(f, ruleTo4, natPort)
	r.tcpFlags = tcpFIN | tcpACK
	e.ingress(r.packet())
	var v NATValV4
	k := NATKeyV4{Src: Addr4(client4), Dst: Addr4(remote4), Sport: Port(40000), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
	if err := e.dp.Maps.NatV4.Lookup(k, &v); err != nil {
		t.Fatalf("NAT pair gone with the rule, before its flow ended: %v", err)
	}
	f.tcpFlags = tcpSYN
	untouched(t, e, f, CounterSkipNotSource)
	f.tcpFlags = tcpACK
	untouched(t, e, f, CounterSkipNotSource)
	if err := e.dp.Maps.NatV4.Lookup(k, &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Fatalf("the closed pair outlived the new flow of its tuple: %v", err)
	}
	if err := deleteMasqRule(e.dp, loIfindex, clients4); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Fatalf("deleting a missing rule: %v, want ErrKeyNotExist", err)
	}
}

func TestMasqRuleFragments(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, clients4, ruleTo4)
	f := flow{src: client4, dst: remote4, proto: protoUDP, sport: 6000, dport: 7000, payload: bytes.Repeat([]byte("x"), 24), ipID: 0x4242}
	l4 := f.l4()
	o1 := e.egress(ether(ipPacket(client4, remote4, protoUDP, f.ipID, 0x2000, l4[:16])))
	o2 := e.egress(ether(ipPacket(client4, remote4, protoUDP, f.ipID, 16/8, l4[16:])))
	if p1, p2 := parseIP(t, o1[14:]), parseIP(t, o2[14:]); p1.src != ruleTo4 || p2.src != ruleTo4 {
		t.Fatalf("fragments sent from %v and %v, want %v", p1.src, p2.src, ruleTo4)
	}

	// A later fragment of a rule source without its first is dropped.
	orphan := ether(ipPacket(client4, remote4, protoUDP, 0x4343, 16/8, l4[16:]))
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, orphan); ret != tcActShot {
		t.Fatalf("orphan fragment verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterFragUnknown: 1})
}

func TestMasqRulePinned(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, clients4, ruleTo4)
	e.reload(t, LoadOptions{})
	ruleFlow(t, e, flow{src: client4, dst: remote4, proto: protoUDP, sport: 5000, dport: 53}, ruleTo4)
}

func TestMasqRuleKeys(t *testing.T) {
	k4 := MasqRuleKeyV4From(3, netip.MustParsePrefix("192.168.6.7/24"))
	if k4.Prefixlen != 56 || k4.Ifindex != 3 || k4.Addr != [4]byte{192, 168, 6, 0} {
		t.Fatalf("v4 key %+v", k4)
	}
	if k4.Source() != clients4 || k4.String() != "ifindex 3 192.168.6.0/24" {
		t.Fatalf("v4 key reads back as %v (%s)", k4.Source(), k4)
	}
	if m := MasqRuleKeyV4From(3, netip.MustParsePrefix("::ffff:192.168.6.0/120")); m != k4 {
		t.Fatalf("IPv4-mapped source gave %+v, want %+v", m, k4)
	}
	k6 := MasqRuleKeyV6From(3, netip.MustParsePrefix("fd00:6::1/64"))
	if k6.Prefixlen != 96 || k6.Ifindex != 3 || k6.Source() != clients6 {
		t.Fatalf("v6 key %+v", k6)
	}

	if v := MasqRuleTo(netip.Addr{}); v != (MasqRule{}) {
		t.Fatalf("no toAddress: %+v", v)
	}
	if v := MasqRuleTo(ruleTo4); v.HasTo != 1 || AddrFrom4(v.ToV4) != ruleTo4 {
		t.Fatalf("v4 toAddress: %+v", v)
	}
	if v := MasqRuleTo(ruleTo6); v.HasTo != 1 || netip.AddrFrom16(v.ToV6) != ruleTo6 {
		t.Fatalf("v6 toAddress: %+v", v)
	}
}

// frag6 wraps part of an L4 datagram in IPv6 with a fragment header: off
// in bytes, more for every fragment but the last.
func frag6(src, dst netip.Addr, id uint32, off int, more bool, part []byte) []byte {
	h := make([]byte, 8)
	h[0] = protoUDP
	fo := uint16(off/8) << 3
	if more {
		fo |= 1
	}
	binary.BigEndian.PutUint16(h[2:], fo)
	binary.BigEndian.PutUint32(h[4:], id)
	return ether(ipPacket(src, dst, 44, 0, 0, append(h, part...)))
}

// TestFormerSourceFragments: a source stops being a masquerade source (its
// rule removed, or its pod CIDR) while a UDP flow of it runs; the flow
// keeps its translation (Linux keeps the conntrack entry's NAT), and so do
// the later fragments of its fragmented datagrams, not only the first:
// they were passed with the source's own address. The node's own later
// fragments (no record) still pass untouched. IPv4 (a rule's source) and
// IPv6 (a pod source).
func TestFormerSourceFragments(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.setRule(loIfindex, clients4, ruleTo4)
	f4 := flow{src: client4, dst: remote4, proto: protoUDP, sport: 6000, dport: 7000, payload: []byte("first")}
	ruleFlow(t, e, f4, ruleTo4)
	f6 := flow{src: pod6, dst: remote6, proto: protoUDP, sport: 6000, dport: 7000, payload: []byte("first")}
	masqueraded(t, e.egress(f6.packet()), f6, snat6)
	if err := deleteMasqRule(e.dp, loIfindex, clients4); err != nil {
		t.Fatal(err)
	}
	if err := e.dp.Maps.MasqSrcV6.Delete(LPMKeyV6From(netip.MustParsePrefix("fd00:10::/64"))); err != nil {
		t.Fatal(err)
	}

	// A UDP datagram of 8+24 bytes split after 16 bytes of UDP.
	f4.payload, f4.ipID = bytes.Repeat([]byte("x"), 24), 0x4242
	l4 := f4.l4()
	before := e.counters()
	o1 := e.egress(ether(ipPacket(client4, remote4, protoUDP, f4.ipID, 0x2000, l4[:16])))
	o2 := e.egress(ether(ipPacket(client4, remote4, protoUDP, f4.ipID, 16/8, l4[16:])))
	p1, p2 := parseIP(t, o1[14:]), parseIP(t, o2[14:])
	if p1.src != ruleTo4 || p2.src != ruleTo4 {
		t.Fatalf("IPv4 fragments of a former source's flow sent from %v and %v, want %v", p1.src, p2.src, ruleTo4)
	}
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterFormerSource: 1, CounterFragments: 1})
	checkL4(t, parsed{src: ruleTo4, dst: remote4, proto: protoUDP, l4: append(bytes.Clone(p1.l4), p2.l4...)})

	f6.payload = bytes.Repeat([]byte("y"), 24)
	l6 := f6.l4()
	before = e.counters()
	o1 = e.egress(frag6(pod6, remote6, 0x4343, 0, true, l6[:16]))
	o2 = e.egress(frag6(pod6, remote6, 0x4343, 16, false, l6[16:]))
	if s1, s2 := netip.AddrFrom16([16]byte(o1[14+8:14+24])), netip.AddrFrom16([16]byte(o2[14+8:14+24])); s1 != snat6 || s2 != snat6 {
		t.Fatalf("IPv6 fragments of a former source's flow sent from %v and %v, want %v", s1, s2, snat6)
	}
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterFormerSource: 1, CounterFragments: 1})

	// The node's own later fragment has no record: untouched.
	node := ether(ipPacket(host, remote4, protoUDP, 0x5151, 16/8, l4[16:]))
	before = e.counters()
	unchanged(t, node, e.egress(node))
	e.checkCounters(before, map[Counter]uint64{CounterSkipNotSource: 1})
}

// TestIPv6ChainOverrunDropped: an IPv6 packet from a masquerade source
// whose extension header chain runs past the packet's end cannot be
// translated (no transport header to find): dropped and counted
// (drop-untranslatable) toward a masqueraded destination, never passed
// with the pod's address; passed toward a non-masquerade one, and from a
// source that is not a masquerade source.
func TestIPv6ChainOverrunDropped(t *testing.T) {
	e := newEnv(t, envOptions{})
	for _, c := range []struct {
		name string
		ext  []byte
	}{
		{"chain ends with the packet", nil},
		{"header longer than the packet", []byte{60, 8, 1, 4, 0, 0, 0, 0}}, // hop-by-hop, 72 bytes claimed
	} {
		t.Run(c.name, func(t *testing.T) {
			build := func(src, dst netip.Addr) []byte {
				return ether(ipPacket(src, dst, 0 /* hop-by-hop */, 0, 0, c.ext))
			}
			before := e.counters()
			if ret, _ := e.run(e.dp.Egress, build(pod6, remote6)); ret != tcActShot {
				t.Fatalf("verdict %d, want TC_ACT_SHOT", int32(ret))
			}
			e.checkCounters(before, map[Counter]uint64{CounterDropUntranslatable: 1})
			for _, in := range [][]byte{build(pod6, netip.MustParseAddr("fd00:20::1")), build(netip.MustParseAddr("fd00:ffff::1"), remote6)} {
				if out := e.egress(in); !bytes.Equal(out, in) {
					t.Fatal("a packet the program does not translate was modified")
				}
			}
		})
	}
}
