package bpf

import (
	"net"
	"net/netip"
	"runtime"
	"testing"

	"github.com/vishvananda/netns"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// The source-port tests run their packets inside a network namespace of
// their own: with MASQ_CFG_KEEP_PORT the programs ask the socket table of the
// namespace they run in (the test run's), which must hold only the sockets
// a test opens.

// keepPortEnv is newEnv with the source's own port kept, in a fresh netns;
// fn runs on a thread inside it.
func keepPortEnv(t *testing.T, o envOptions, fn func(e *testEnv)) {
	t.Helper()
	ns, _ := privtest.NewNetns(t)
	e := newEnv(t, o)
	if err := e.dp.SetKeepSourcePort(true); err != nil {
		t.Fatal(err)
	}
	// netnstest.Do, which this package cannot import (a cycle through the
	// reconcilers).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			panic("restore network namespace: " + err.Error())
		}
	}()
	fn(e)
}

// TestSourcePortKept: like Linux MASQUERADE, a flow keeps its own source
// port when no other flow holds that port toward the same destination; a
// second pod with the same port to the same destination gets a port of the
// random one (outside the range, or of the range), to another destination
// it keeps its own. Replies of both reach their pods. Ports below 1024 are
// not kept; ICMP ids always come from the range.
func TestSourcePortKept(t *testing.T) {
	keepPortEnv(t, envOptions{}, func(e *testEnv) {
		for _, proto := range []uint8{protoTCP, protoUDP} {
			a := flow{src: pod1, dst: remote4, proto: proto, sport: 40000, dport: 443}
			before := e.counters()
			fromSNATPort(t, e.egress(a.packet()), snat4, 40000)
			e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1, CounterNATPortKept: 1})
			if p := parse(t, e.ingress(reply(a, snat4, 40000).packet())); p.dst != pod1 || p.dport != 40000 {
				t.Fatalf("proto %d: reply to the kept port went to %v:%d", proto, p.dst, p.dport)
			}

			b := flow{src: pod2, dst: remote4, proto: proto, sport: 40000, dport: 443}
			port := notKept(t, e.egress(b.packet()), snat4, 40000)
			if p := parse(t, e.ingress(reply(b, snat4, port).packet())); p.dst != pod2 || p.dport != 40000 {
				t.Fatalf("proto %d: reply of the second pod went to %v:%d", proto, p.dst, p.dport)
			}
			c := flow{src: pod2, dst: remote4, proto: proto, sport: 40000, dport: 444}
			fromSNATPort(t, e.egress(c.packet()), snat4, 40000)

			low := flow{src: pod1, dst: remote4, proto: proto, sport: 123, dport: 123}
			notKept(t, e.egress(low.packet()), snat4, 123)
		}
		ping := flow{src: pod1, dst: remote4, proto: protoICMP, sport: 40000, icmpType: 8}
		masqueraded(t, e.egress(ping.packet()), ping, snat4)

		v6 := flow{src: pod6, dst: remote6, proto: protoTCP, sport: 40000, dport: 443}
		fromSNATPort(t, e.egress(v6.packet()), snat6, 40000)
		if p := parse(t, e.ingress(reply(v6, snat6, 40000).packet())); p.dst != pod6 || p.dport != 40000 {
			t.Fatalf("IPv6 reply to the kept port went to %v:%d", p.dst, p.dport)
		}
	})
}

// notKept requires out to leave from snat with a port other than own, and
// returns that port.
func notKept(t *testing.T, out []byte, snat netip.Addr, own uint16) uint16 {
	t.Helper()
	p := parse(t, out)
	if p.src != snat || p.sport == own {
		t.Fatalf("got %v:%d, want %v and a port other than %d", p.src, p.sport, snat, own)
	}
	return p.sport
}

// TestSourcePortKeptOnlyWhenAsked: with the flag off (--nat-keep-source-port
// =false) every flow gets a port of the range.
func TestSourcePortKeptOnlyWhenAsked(t *testing.T) {
	e := newEnv(t, envOptions{})
	a := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	masqueraded(t, e.egress(a.packet()), a, snat4)
}

// TestSourcePortNotKeptOverNodeSocket: the port is not kept where a node
// socket would receive the replies (a bound UDP socket, a TCP listener, an
// established connection), since ports outside the range are not reserved
// from the node.
func TestSourcePortNotKeptOverNodeSocket(t *testing.T) {
	keepPortEnv(t, envOptions{}, func(e *testEnv) {
		udp4, err := net.ListenPacket("udp4", "0.0.0.0:40001")
		if err != nil {
			t.Fatal(err)
		}
		defer udp4.Close()
		tcp4, err := net.Listen("tcp4", "0.0.0.0:40002")
		if err != nil {
			t.Fatal(err)
		}
		defer tcp4.Close()
		udp6, err := net.ListenPacket("udp6", "[::]:40001")
		if err != nil {
			t.Fatal(err)
		}
		defer udp6.Close()

		for _, f := range []flow{
			{src: pod1, dst: remote4, proto: protoUDP, sport: 40001, dport: 53},
			{src: pod1, dst: remote4, proto: protoTCP, sport: 40002, dport: 443},
		} {
			before := e.counters()
			notKept(t, e.egress(f.packet()), snat4, f.sport)
			e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterNATNew: 1})
		}
		f6 := flow{src: pod6, dst: remote6, proto: protoUDP, sport: 40001, dport: 53}
		notKept(t, e.egress(f6.packet()), snat6, 40001)
		// A port no socket holds is kept: the lookups ran in this netns.
		free := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40003, dport: 443}
		fromSNATPort(t, e.egress(free.packet()), snat4, 40003)
	})
}

// TestNodeFlowRemappedWherePodKeptPort: the node's kernel does not know the
// ports pods kept, so it may pick one for its own connection to the same
// destination. That node flow is given a port of the range, both ways, as
// conntrack remaps a clashing tuple, and the pod's flow carries on.
func TestNodeFlowRemappedWherePodKeptPort(t *testing.T) {
	keepPortEnv(t, envOptions{}, func(e *testEnv) {
		if err := e.dp.Maps.NodeAddrsV4.Put(snat4.As4(), uint8(1)); err != nil {
			t.Fatal(err)
		}
		if err := e.dp.Maps.NodeAddrsV6.Put(snat6.As16(), uint8(1)); err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			pod, remote, snat netip.Addr
		}{{pod1, remote4, snat4}, {pod6, remote6, snat6}} {
			pod := flow{src: c.pod, dst: c.remote, proto: protoTCP, sport: 40000, dport: 443}
			fromSNATPort(t, e.egress(pod.packet()), c.snat, 40000)

			node := flow{src: c.snat, dst: c.remote, proto: protoTCP, sport: 40000, dport: 443}
			before := e.counters()
			p := parse(t, e.egress(node.packet()))
			if p.src != c.snat || !inRange(p.sport) {
				t.Fatalf("node flow on a pod's kept port left as %v:%d, want %v and a port of the range", p.src, p.sport, c.snat)
			}
			e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterHostFlowRemapped: 1})
			remapped := p.sport
			node.tcpFlags = tcpACK
			if p := parse(t, e.egress(node.packet())); p.sport != remapped {
				t.Fatalf("node flow's next packet left from port %d, its first from %d", p.sport, remapped)
			}
			if p := parse(t, e.ingress(reply(node, c.snat, remapped).packet())); p.dst != c.snat || p.dport != 40000 {
				t.Fatalf("reply of the remapped node flow went to %v:%d, want %v:40000", p.dst, p.dport, c.snat)
			}
			if p := parse(t, e.ingress(reply(pod, c.snat, 40000).packet())); p.dst != c.pod || p.dport != 40000 {
				t.Fatalf("the pod's reply went to %v:%d after the node flow", p.dst, p.dport)
			}

			// A node flow on a port no pod holds is left alone.
			other := flow{src: c.snat, dst: c.remote, proto: protoTCP, sport: 40001, dport: 443}
			before = e.counters()
			in := other.packet()
			unchanged(t, in, e.egress(in))
			e.checkCounters(before, map[Counter]uint64{CounterSkipNotSource: 1})
		}
	})
}

// TestClashesGoBeyondTheRange: flows whose own port is taken are not
// bounded by the range (Linux remaps a clash into 1024-65535): with a
// one-port range, many pods with the same port to one destination all get
// a port, each a different one.
func TestClashesGoBeyondTheRange(t *testing.T) {
	keepPortEnv(t, envOptions{portMin: 61000, portMax: 61000}, func(e *testEnv) {
		seen := map[uint16]bool{}
		for i := range 20 {
			src := netip.AddrFrom4([4]byte{10, 0, 3, byte(1 + i)})
			f := flow{src: src, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
			p := parse(t, e.egress(f.packet()))
			if p.src != snat4 || seen[p.sport] {
				t.Fatalf("pod %d: left as %v:%d (ports so far %v)", i, p.src, p.sport, seen)
			}
			seen[p.sport] = true
			if p := parse(t, e.ingress(reply(f, snat4, p.sport).packet())); p.dst != src || p.dport != 40000 {
				t.Fatalf("pod %d: reply went to %v:%d", i, p.dst, p.dport)
			}
		}
	})
}
