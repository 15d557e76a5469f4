package bpf

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/testkit/privtest"

	"github.com/cilium/ebpf"
)

// The tests load the programs into the kernel with maps pinned in a private
// bpffs and run packets through them with BPF_PROG_TEST_RUN. The egress
// device is lo (ifindex 1), which is what the test run's skb uses.

const (
	tcActUnspec = 0xffffffff // TC_ACT_UNSPEC (-1)
	tcActShot   = 2
	loIfindex   = 1
)

var (
	pod1    = netip.MustParseAddr("10.0.1.5")
	pod2    = netip.MustParseAddr("10.0.2.9")
	host    = netip.MustParseAddr("172.16.0.1") // node address, not a source
	snat4   = netip.MustParseAddr("203.0.113.1")
	remote4 = netip.MustParseAddr("8.8.8.8")
	router4 = netip.MustParseAddr("198.51.100.9")

	pod6    = netip.MustParseAddr("fd00:10::5")
	snat6   = netip.MustParseAddr("2001:db8::1")
	remote6 = netip.MustParseAddr("2001:4860::8888")
	router6 = netip.MustParseAddr("2001:db8:ffff::1")
)

// skbContext is the head of struct __sk_buff up to ifindex; the kernel
// requires the other fields to be zero.
type skbContext struct {
	_       [10]uint32
	Ifindex uint32
}

type testEnv struct {
	tb     testing.TB
	dp     *Datapath
	pinDir string
}

type envOptions struct {
	natMax           uint32
	portMin, portMax uint16
	// object is another build of masq.c (a baseline for benchmarks) to
	// load instead of the embedded one; empty: the embedded one.
	object string
	// natMapKind changes the NAT maps' kind (BenchmarkNATMapKinds).
	natMapKind func(*ebpf.MapSpec)
	// variant is the build to load; empty: the package's
	// (IPMASQ_TEST_DATAPATH_VARIANT, else the kernel's).
	variant Variant
}

// newEnv loads the datapath with nonmasq tries of a size other than the
// program's default (--max-nonmasq-cidrs) and fills the maps:
//
//	sources     10.0.0.0/16, fd00:10::/64
//	nonmasq     192.168.0.0/16 (0), 192.168.7.0/24 (1: masqueradeCIDRs exception), fd00::/8 (0)
//	node addrs  172.16.0.1, fd00:ffff::1
//	lo          SNAT 203.0.113.1, 2001:db8::1
func newEnv(tb testing.TB, o envOptions) *testEnv {
	tb.Helper()
	privtest.Require(tb)
	root := privtest.MountBPFFS(tb)
	pinDir := filepath.Join(root, "ipmasq")

	var dp *Datapath
	var err error
	if o.object != "" {
		dp = loadObject(tb, o.object, o.natMax)
	} else if dp, err = Load(LoadOptions{PinDir: pinDir, NonMasqMaxEntries: 100, NATMaxEntries: o.natMax,
		natMapKind: o.natMapKind, Variant: o.variant}); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { dp.Close() })
	e := &testEnv{tb: tb, dp: dp, pinDir: pinDir}

	put := func(m *ebpf.Map, k, v any) {
		tb.Helper()
		if err := m.Put(k, v); err != nil {
			tb.Fatalf("put %s %v: %v", m, k, err)
		}
	}
	v4 := func(s string) LPMKeyV4 { return LPMKeyV4From(netip.MustParsePrefix(s)) }
	v6 := func(s string) LPMKeyV6 { return LPMKeyV6From(netip.MustParsePrefix(s)) }
	put(dp.Maps.MasqSrcV4, v4(podSources4.String()), MasqSrcMasquerade)
	put(dp.Maps.MasqSrcV6, v6(podSources6.String()), MasqSrcMasquerade)
	put(dp.Maps.NonmasqV4, v4("192.168.0.0/16"), uint8(0))
	put(dp.Maps.NonmasqV4, v4("192.168.7.0/24"), uint8(1))
	put(dp.Maps.NonmasqV6, v6("fd00::/8"), uint8(0))
	put(dp.Maps.NodeAddrsV4, host.As4(), uint8(1))
	put(dp.Maps.NodeAddrsV6, netip.MustParseAddr("fd00:ffff::1").As16(), uint8(1))
	if err := dp.SetEgressDevice(loIfindex, snat4, snat6); err != nil {
		tb.Fatal(err)
	}
	if o.portMin == 0 {
		o.portMin, o.portMax = 61000, 65535
	}
	if err := dp.SetPortRange(o.portMin, o.portMax); err != nil {
		tb.Fatal(err)
	}
	if err := dp.SetLifetimes(DefaultLifetimes); err != nil {
		tb.Fatal(err)
	}
	return e
}

// reload loads the datapath again on e's pins, as a restarted agent does,
// and makes it e's datapath (the previous one closed).
func (e *testEnv) reload(t testing.TB, opts LoadOptions) {
	t.Helper()
	opts.PinDir = e.pinDir
	dp, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	e.dp.Close()
	e.dp = dp
	t.Cleanup(func() { dp.Close() })
}

func (e *testEnv) run(prog *ebpf.Program, frame []byte) (uint32, []byte) {
	e.tb.Helper()
	out := make([]byte, len(frame)+256)
	opts := &ebpf.RunOptions{Data: frame, DataOut: out, Context: skbContext{Ifindex: loIfindex}}
	ret, err := prog.Run(opts)
	if err != nil {
		e.tb.Fatalf("test run: %v", err)
	}
	return ret, opts.DataOut
}

// egress runs a frame through ipmasq_egress and requires TC_ACT_UNSPEC.
func (e *testEnv) egress(frame []byte) []byte {
	e.tb.Helper()
	ret, out := e.run(e.dp.Egress, frame)
	if ret != tcActUnspec {
		e.tb.Fatalf("egress verdict %d, want TC_ACT_UNSPEC", int32(ret))
	}
	return out
}

func (e *testEnv) ingress(frame []byte) []byte {
	e.tb.Helper()
	ret, out := e.run(e.dp.Ingress, frame)
	if ret != tcActUnspec {
		e.tb.Fatalf("ingress verdict %d, want TC_ACT_UNSPEC", int32(ret))
	}
	return out
}

// counters returns the global counters, followed by the per-device drops
// of each DropReason summed over devices, families and directions.
func (e *testEnv) counters() []uint64 {
	e.tb.Helper()
	c, err := ReadCounters(e.dp.Maps.Counters)
	if err != nil {
		e.tb.Fatal(err)
	}
	drops := make([]uint64, NumDropReasons)
	if e.dp.Maps.DevCounters == nil || e.dp.Maps.DevCounters.ValueSize() != uint32(binary.Size(masqDevCounterVal{})) {
		// An older object (-bpf.baseline) has no per-device counters, or
		// fewer drop reasons than this tree's layout reads.
		return append(c, drops...)
	}
	devs, err := ReadDevCounters(e.dp.Maps.DevCounters)
	if err != nil {
		e.tb.Fatal(err)
	}
	for _, d := range devs {
		for r, n := range d.Drops {
			drops[r] += n
		}
	}
	return append(c, drops...)
}

// dropReasonOf is the per-device drop reason of the global counters that
// always mean a dropped packet.
var dropReasonOf = map[Counter]DropReason{
	CounterDropUntranslatable: DropUntranslatable,
	CounterNATFull:            DropNATFull,
	CounterNoPort:             DropNoPort,
	CounterFragUnknown:        DropFragmentUnknown,
	CounterDropNoSNATAddr:     DropNoSNATAddress,
	CounterICMPErrorUnknown:   DropICMPErrorUnmatched,
	CounterPairTaken:          DropPairTaken,
}

// checkCounters compares the counters named in want with their change
// since before; a drop counter's packets must also show as drops of its
// reason in the per-device counters.
func (e *testEnv) checkCounters(before []uint64, want map[Counter]uint64) {
	e.tb.Helper()
	now := e.counters()
	for c := Counter(0); c < NumCounters; c++ {
		if got := now[c] - before[c]; got != want[c] {
			e.tb.Errorf("counter %s went up by %d, want %d", c, got, want[c])
		}
	}
	for c, r := range dropReasonOf {
		if got := now[int(NumCounters)+int(r)] - before[int(NumCounters)+int(r)]; got != want[c] {
			e.tb.Errorf("per-device drops for reason %s went up by %d, want %d (counter %s)", r, got, want[c], c)
		}
	}
}

func inRange(p uint16) bool { return p >= 61000 && p <= 65535 }

// masqueraded checks an egress output against the original flow and
// returns the NAT port.
func masqueraded(t *testing.T, out []byte, f flow, snat netip.Addr) uint16 {
	t.Helper()
	p := parse(t, out)
	if p.src != snat || p.dst != f.dst {
		t.Fatalf("translated %v -> %v, want %v -> %v", p.src, p.dst, snat, f.dst)
	}
	if !inRange(p.sport) {
		t.Fatalf("NAT port %d outside 61000-65535", p.sport)
	}
	if f.proto != protoICMP && f.proto != protoICMPv6 && p.dport != f.dport {
		t.Fatalf("destination port changed to %d", p.dport)
	}
	return p.sport
}

// reply builds the remote's answer to a translated packet.
func reply(f flow, snat netip.Addr, natPort uint16) flow {
	r := f
	r.src, r.dst = f.dst, snat
	r.sport, r.dport = f.dport, natPort
	if f.proto == protoICMP || f.proto == protoICMPv6 {
		r.sport = natPort
		r.icmpType = map[uint8]uint8{protoICMP: 0, protoICMPv6: 129}[f.proto]
	}
	r.tcpFlags = tcpSYN | tcpACK
	return r
}

func TestMasqueradeTCPv4(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN, payload: []byte("hello")}

	before := e.counters()
	natPort := masqueraded(t, e.egress(f.packet()), f, snat4)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1})

	// The same flow reuses its mapping.
	before = e.counters()
	f.tcpFlags = tcpACK
	if again := masqueraded(t, e.egress(f.packet()), f, snat4); again != natPort {
		t.Fatalf("second packet got NAT port %d, first %d", again, natPort)
	}
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1})

	// The reply goes back to the pod.
	before = e.counters()
	p := parse(t, e.ingress(reply(f, snat4, natPort).packet()))
	if p.dst != pod1 || p.dport != 40000 || p.src != remote4 || p.sport != 443 {
		t.Fatalf("reply translated to %v:%d -> %v:%d", p.src, p.sport, p.dst, p.dport)
	}
	e.checkCounters(before, map[Counter]uint64{CounterReverse: 1})

	// Both entries are there, with the contract's layout.
	var v NATValV4
	key := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(40000), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
	if err := e.dp.Maps.NatV4.Lookup(key, &v); err != nil {
		t.Fatalf("egress entry: %v", err)
	}
	if AddrFrom4(v.Addr) != snat4 || HostPort(v.Port) != natPort || v.CreatedNs == 0 || v.LastSeenNs < v.CreatedNs {
		t.Fatalf("egress entry %+v", v)
	}
	key = NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(natPort), Proto: protoTCP, Dir: DirIngress}
	if err := e.dp.Maps.NatV4.Lookup(key, &v); err != nil {
		t.Fatalf("ingress entry: %v", err)
	}
	if AddrFrom4(v.Addr) != pod1 || HostPort(v.Port) != 40000 {
		t.Fatalf("ingress entry %+v", v)
	}

	// A FIN is recorded for the collector.
	f.tcpFlags = tcpFIN | tcpACK
	e.egress(f.packet())
	key = NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(40000), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
	if err := e.dp.Maps.NatV4.Lookup(key, &v); err != nil || v.Flags&NATFlagFIN == 0 {
		t.Fatalf("FIN not recorded: %+v %v", v, err)
	}
}

func TestMasqueradeUDPv4(t *testing.T) {
	e := newEnv(t, envOptions{})
	for _, zero := range []bool{false, true} {
		f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 5353, dport: 53, payload: []byte("query"), zeroUDPCsum: zero}
		if zero {
			f.sport = 5354
		}
		out := e.egress(f.packet())
		natPort := masqueraded(t, out, f, snat4)
		p := parse(t, out)
		if got := binary.BigEndian.Uint16(p.l4[6:]); (got == 0) != zero {
			t.Fatalf("zero checksum %v: got checksum %#x", zero, got)
		}
		r := parse(t, e.ingress(reply(f, snat4, natPort).packet()))
		if r.dst != pod1 || r.dport != f.sport {
			t.Fatalf("reply translated to %v:%d", r.dst, r.dport)
		}
		if got := binary.BigEndian.Uint16(r.l4[6:]); (got == 0) != zero {
			t.Fatalf("reply, zero checksum %v: got checksum %#x", zero, got)
		}
	}
}

func TestMasqueradeICMPEcho(t *testing.T) {
	e := newEnv(t, envOptions{})
	for _, f := range []flow{
		{src: pod1, dst: remote4, proto: protoICMP, icmpType: 8, sport: 1234, payload: []byte("ping")},
		{src: pod6, dst: remote6, proto: protoICMPv6, icmpType: 128, sport: 1234, payload: []byte("ping")},
	} {
		snat := snat4
		if f.src.Is6() {
			snat = snat6
		}
		before := e.counters()
		id := masqueraded(t, e.egress(f.packet()), f, snat)
		r := parse(t, e.ingress(reply(f, snat, id).packet()))
		if r.dst != f.src || r.sport != 1234 {
			t.Fatalf("echo reply translated to %v id %d", r.dst, r.sport)
		}
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterReverse: 1})
	}
}

func TestMasqueradeTCPv6(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod6, dst: remote6, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN, payload: []byte("hello")}
	natPort := masqueraded(t, e.egress(f.packet()), f, snat6)
	for _, udp := range []bool{false, true} {
		g := f
		if udp {
			g.proto, g.sport = protoUDP, 40001
			natPort = masqueraded(t, e.egress(g.packet()), g, snat6)
		}
		p := parse(t, e.ingress(reply(g, snat6, natPort).packet()))
		if p.dst != pod6 || p.dport != g.sport {
			t.Fatalf("reply translated to [%v]:%d", p.dst, p.dport)
		}
	}
}

// icmpError builds an ICMP error from a router about a packet we sent.
func icmpError(from netip.Addr, to netip.Addr, typ, code uint8, quote []byte) []byte {
	var proto uint8 = protoICMP
	if from.Is6() {
		proto = protoICMPv6
	}
	b := make([]byte, 8, 8+len(quote))
	b[0], b[1] = typ, code
	binary.BigEndian.PutUint16(b[6:], 1400) // next-hop MTU / packet-too-big MTU (low half)
	b = append(b, quote...)
	var sum uint32
	if proto == protoICMPv6 {
		sum = pseudoSum(from, to, proto, len(b))
	}
	binary.BigEndian.PutUint16(b[2:], csumFold(csumAdd(sum, b)))
	return ether(ipPacket(from, to, proto, 99, 0, b))
}

func TestICMPErrorForTranslatedFlow(t *testing.T) {
	e := newEnv(t, envOptions{})
	cases := []struct {
		name     string
		f        flow
		router   netip.Addr
		snat     netip.Addr
		typ      uint8
		code     uint8
		truncate bool
	}{
		{"v4 frag needed, full quote", flow{src: pod1, dst: remote4, proto: protoTCP, sport: 41000, dport: 443, tcpFlags: tcpSYN, payload: []byte("data")}, router4, snat4, 3, 4, false},
		{"v4 frag needed, 8 byte quote", flow{src: pod1, dst: remote4, proto: protoTCP, sport: 41001, dport: 443, tcpFlags: tcpSYN}, router4, snat4, 3, 4, true},
		{"v4 port unreachable, UDP", flow{src: pod1, dst: remote4, proto: protoUDP, sport: 41002, dport: 53, payload: []byte("q")}, remote4, snat4, 3, 3, false},
		{"v4 time exceeded, echo", flow{src: pod1, dst: remote4, proto: protoICMP, icmpType: 8, sport: 777, payload: []byte("p")}, router4, snat4, 11, 0, false},
		{"v6 packet too big", flow{src: pod6, dst: remote6, proto: protoTCP, sport: 41000, dport: 443, tcpFlags: tcpSYN, payload: []byte("data")}, router6, snat6, 2, 0, false},
		{"v6 time exceeded, UDP", flow{src: pod6, dst: remote6, proto: protoUDP, sport: 41002, dport: 53, payload: []byte("q")}, router6, snat6, 3, 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := e.egress(c.f.packet())
			masqueraded(t, out, c.f, c.snat)
			quote := bytes.Clone(out[14:])
			if c.truncate {
				quote = quote[:20+8]
			}
			before := e.counters()
			res := e.ingress(icmpError(c.router, c.snat, c.typ, c.code, quote))
			e.checkCounters(before, map[Counter]uint64{CounterICMPErrorReverse: 1})

			outer := parse(t, res) // outer IPv4 header and ICMP checksums
			if outer.dst != c.f.src || outer.src != c.router {
				t.Fatalf("outer %v -> %v, want %v -> %v", outer.src, outer.dst, c.router, c.f.src)
			}
			inner := parseIP(t, outer.l4[8:]) // quoted IPv4 header checksum
			if inner.src != c.f.src || inner.dst != c.f.dst || inner.sport != c.f.sport {
				t.Fatalf("quote %v:%d -> %v, want %v:%d -> %v", inner.src, inner.sport, inner.dst, c.f.src, c.f.sport, c.f.dst)
			}
			if !c.truncate {
				checkL4(t, inner) // the quote is the whole packet
				if !bytes.Equal(outer.l4[8:], c.f.packet()[14:]) {
					t.Fatalf("quote is not the original packet:\n got %x\nwant %x", outer.l4[8:], c.f.packet()[14:])
				}
			}
		})
	}

	// An error about something we did not translate passes untouched.
	f := flow{src: snat4, dst: remote4, proto: protoTCP, sport: 33000, dport: 443, tcpFlags: tcpACK}
	in := icmpError(router4, snat4, 3, 4, f.packet()[14:])
	if out := e.ingress(in); !bytes.Equal(out, in) {
		t.Fatal("ICMP error for a host flow was modified")
	}
}

func TestNotMasqueraded(t *testing.T) {
	e := newEnv(t, envOptions{})
	cases := []struct {
		name string
		f    flow
		want Counter // CounterMasqueraded: translated
	}{
		{"not a source", flow{src: host, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}, CounterSkipNotSource},
		{"non-masquerade destination", flow{src: pod1, dst: netip.MustParseAddr("192.168.1.1"), proto: protoTCP, sport: 40000, dport: 443}, CounterSkipNonMasqDst},
		{"masqueradeCIDRs exception inside it", flow{src: pod1, dst: netip.MustParseAddr("192.168.7.7"), proto: protoTCP, sport: 40000, dport: 443}, CounterMasqueraded},
		{"node address destination", flow{src: pod1, dst: host, proto: protoUDP, sport: 40000, dport: 53}, CounterSkipNodeDst},
		{"v6 non-masquerade destination", flow{src: pod6, dst: netip.MustParseAddr("fd00:20::1"), proto: protoUDP, sport: 40000, dport: 53}, CounterSkipNonMasqDst},
		{"v6 not a source", flow{src: snat6, dst: remote6, proto: protoUDP, sport: 40000, dport: 53}, CounterSkipNotSource},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := e.counters()
			in := c.f.packet()
			out := e.egress(in)
			want := map[Counter]uint64{c.want: 1}
			if c.want == CounterMasqueraded {
				masqueraded(t, out, c.f, snat4)
				want[CounterNATNew] = 1
			} else if !bytes.Equal(in, out) {
				t.Fatalf("packet modified:\n got %x\nwant %x", out, in)
			}
			if c.want == CounterSkipNonMasqDst {
				// a new flow left alone: its decision is recorded
				want[CounterUnmasqNew] = 1
			}
			e.checkCounters(before, want)
		})
	}

	t.Run("device without SNAT address", func(t *testing.T) {
		if err := e.dp.SetEgressDevice(loIfindex, netip.Addr{}, snat6); err != nil {
			t.Fatal(err)
		}
		defer e.dp.SetEgressDevice(loIfindex, snat4, snat6)
		// Dropped, as MASQUERADE does: the pod address never leaves.
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40100, dport: 443}
		before := e.counters()
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
			t.Fatalf("verdict %d, want TC_ACT_SHOT", int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterDropNoSNATAddr: 1})
	})
}

func TestTwoPodsSameSourcePort(t *testing.T) {
	e := newEnv(t, envOptions{})
	f1 := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	f2 := f1
	f2.src = pod2
	p1 := masqueraded(t, e.egress(f1.packet()), f1, snat4)
	p2 := masqueraded(t, e.egress(f2.packet()), f2, snat4)
	if p1 == p2 {
		t.Fatalf("both pods got NAT port %d", p1)
	}
	for _, c := range []struct {
		f    flow
		port uint16
	}{{f1, p1}, {f2, p2}} {
		r := parse(t, e.ingress(reply(c.f, snat4, c.port).packet()))
		if r.dst != c.f.src || r.dport != 40000 {
			t.Fatalf("reply to port %d went to %v:%d", c.port, r.dst, r.dport)
		}
	}
}

func TestPortRangeExhausted(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61001})
	f := flow{src: pod1, dst: remote4, proto: protoUDP, dport: 53}
	for i := range uint16(2) {
		f.sport = 1000 + i
		out := e.egress(f.packet())
		if p := parse(t, out); p.sport != 61000 && p.sport != 61001 {
			t.Fatalf("NAT port %d outside 61000-61001", p.sport)
		}
	}
	before := e.counters()
	f.sport = 1002
	if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
		t.Fatalf("third flow: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})

	// A port is per destination: another server still gets one.
	g := flow{src: pod1, dst: netip.MustParseAddr("1.1.1.1"), proto: protoUDP, sport: 1002, dport: 53}
	masqueradedRange(t, e.egress(g.packet()), 61000, 61001)
}

func masqueradedRange(t *testing.T, out []byte, min, max uint16) {
	t.Helper()
	p := parse(t, out)
	if p.src != snat4 || p.sport < min || p.sport > max {
		t.Fatalf("got %v:%d, want %v:%d-%d", p.src, p.sport, snat4, min, max)
	}
}

// TestFullNATTableAdmitsNewFlows: a full table admits each new flow by
// dropping a pair that is not assured (here the earlier unanswered UDP
// flows), both halves, with no agent involved (conntrack's early drop),
// while a UDP stream in use (answered, active for more than 2 s) keeps its
// port and its replies.
func TestFullNATTableAdmitsNewFlows(t *testing.T) {
	const natMax = 64 // 32 pairs
	e := newEnv(t, envOptions{natMax: natMax})
	busy := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 999, dport: 53}
	port := masqueraded(t, e.egress(busy.packet()), busy, snat4)
	e.ingress(reply(busy, snat4, port).packet())
	e.age(3 * time.Second)
	e.ingress(reply(busy, snat4, port).packet()) // a stream now
	before := e.counters()
	f := flow{src: pod1, dst: remote4, proto: protoUDP, dport: 53}
	for i := range uint16(4 * natMax) {
		f.sport = 1000 + i
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret == tcActShot {
			t.Fatalf("new flow %d of %d with the table full: TC_ACT_SHOT\n%v", i, 4*natMax, e.counters())
		}
		masqueraded(t, e.egress(f.packet()), f, snat4)
		// The busy pair is used both ways all along.
		if got := masqueraded(t, e.egress(busy.packet()), busy, snat4); got != port {
			t.Fatalf("after %d new flows the busy pair's port is %d, was %d", i+1, got, port)
		}
		if p := parse(t, e.ingress(reply(busy, snat4, port).packet())); p.dst != pod1 || p.dport != busy.sport {
			t.Fatalf("after %d new flows the busy pair's reply went to %v:%d", i+1, p.dst, p.dport)
		}
	}
	now := e.counters()
	for _, c := range []Counter{CounterNATFull, CounterNoPort} {
		if got := now[c] - before[c]; got != 0 {
			t.Errorf("counter %s went up by %d", c, got)
		}
	}
	if got := now[CounterNATEarlyDrop] - before[CounterNATEarlyDrop]; got == 0 {
		t.Error("no pair early-dropped for flows beyond the table's capacity")
	}
	n := e.natCount(false)
	if n[DirEgress]+n[DirIngress] > natMax || n[DirEgress] != n[DirIngress] {
		t.Fatalf("entries by direction %v in a map of %d: want whole pairs only", n, natMax)
	}
	// The newest flow's replies are translated: its pair is whole.
	if p := parse(t, e.ingress(reply(f, snat4, parse(t, e.egress(f.packet())).sport).packet())); p.dst != pod1 || p.dport != f.sport {
		t.Fatalf("newest flow's reply went to %v:%d", p.dst, p.dport)
	}
}

func TestFragmentsV4(t *testing.T) {
	e := newEnv(t, envOptions{})
	// A UDP datagram of 8+24 bytes split after 16 bytes of UDP.
	f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 6000, dport: 7000, payload: bytes.Repeat([]byte("x"), 24), ipID: 0x4242}
	l4 := f.l4()
	first := ether(ipPacket(pod1, remote4, protoUDP, f.ipID, 0x2000, l4[:16]))
	second := ether(ipPacket(pod1, remote4, protoUDP, f.ipID, 16/8, l4[16:]))

	before := e.counters()
	o1 := e.egress(first)
	o2 := e.egress(second)
	e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterFragments: 1})
	p1, p2 := parseIP(t, o1[14:]), parseIP(t, o2[14:])
	if p1.src != snat4 || p2.src != snat4 {
		t.Fatalf("fragments sent from %v and %v", p1.src, p2.src)
	}
	// Reassembled, the datagram's checksum is valid.
	whole := append(bytes.Clone(p1.l4), p2.l4...)
	checkL4(t, parsed{src: snat4, dst: remote4, proto: protoUDP, l4: whole})

	// A later fragment whose first fragment was not seen is dropped.
	orphan := ether(ipPacket(pod1, remote4, protoUDP, 0x4343, 16/8, l4[16:]))
	before = e.counters()
	if ret, _ := e.run(e.dp.Egress, orphan); ret != tcActShot {
		t.Fatalf("orphan fragment verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterFragUnknown: 1})

	// Unless its destination is not masqueraded.
	orphan = ether(ipPacket(pod1, netip.MustParseAddr("192.168.1.1"), protoUDP, 0x4343, 16/8, l4[16:]))
	if out := e.egress(orphan); !bytes.Equal(out, orphan) {
		t.Fatal("non-masqueraded fragment modified")
	}

	// Fragmented replies are translated back.
	r := reply(f, snat4, p1.sport)
	rl4 := r.l4()
	o1 = e.ingress(ether(ipPacket(remote4, snat4, protoUDP, 0x5151, 0x2000, rl4[:16])))
	o2 = e.ingress(ether(ipPacket(remote4, snat4, protoUDP, 0x5151, 16/8, rl4[16:])))
	p1, p2 = parseIP(t, o1[14:]), parseIP(t, o2[14:])
	if p1.dst != pod1 || p2.dst != pod1 || p1.dport != 6000 {
		t.Fatalf("reply fragments to %v:%d and %v", p1.dst, p1.dport, p2.dst)
	}
	whole = append(bytes.Clone(p1.l4), p2.l4...)
	checkL4(t, parsed{src: remote4, dst: pod1, proto: protoUDP, l4: whole})
}

func TestPinnedStateSurvivesReload(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	natPort := masqueraded(t, e.egress(f.packet()), f, snat4)

	e.reload(t, LoadOptions{})
	if got := masqueraded(t, e.egress(f.packet()), f, snat4); got != natPort {
		t.Fatalf("after reload NAT port %d, before %d", got, natPort)
	}
}

func TestCounterNames(t *testing.T) {
	seen := map[string]bool{}
	for c := Counter(0); c < NumCounters; c++ {
		if c.String() == "" || seen[c.String()] {
			t.Errorf("counter %d: name %q (seen: %v)", c, c.String(), seen[c.String()])
		}
		seen[c.String()] = true
	}
}

func TestReadCountersNeedsPerCPU(t *testing.T) {
	privtest.Require(t)
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := ReadCounters(m); err == nil {
		t.Fatal("want an error for a map that is not the counters map")
	}
}
