package bpf

import (
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// inFreshNetns runs fn on a thread inside a fresh network namespace, so
// that the programs' socket lookups see only the sockets the test opens.
func inFreshNetns(t *testing.T, fn func()) {
	t.Helper()
	ns, _ := privtest.NewNetns(t)
	if err := inNetns(ns, func() error { fn(); return nil }); err != nil {
		t.Fatal(err)
	}
}

// TestRangePortsAvoidNodeSockets: nothing reserves the NAT range from the
// node any more, so its kernel may give a port of the range to its own
// socket. The search skips every port a node socket owns toward the flow's
// destination (a bound UDP socket, a TCP listener), in the range as
// outside it, as conntrack's nf_nat_used_tuple skips the node's own
// connection's tuple: with nine of ten ports held by node sockets, every
// flow gets the tenth; with all ten held, the flow is refused.
func TestRangePortsAvoidNodeSockets(t *testing.T) {
	inFreshNetns(t, func() {
		e := newEnv(t, envOptions{portMin: 40000, portMax: 40009})
		var closers []func() error
		defer func() {
			for _, c := range closers {
				c()
			}
		}()
		for p := 40000; p <= 40008; p++ {
			switch p % 3 {
			case 0:
				l, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", p))
				if err != nil {
					t.Fatal(err)
				}
				closers = append(closers, l.Close)
				u, err := net.ListenPacket("udp4", fmt.Sprintf("0.0.0.0:%d", p))
				if err != nil {
					t.Fatal(err)
				}
				closers = append(closers, u.Close)
			default:
				// dual-stack sockets on [::]: they hold the port for
				// IPv4 and IPv6
				for _, nw := range []string{"tcp", "udp"} {
					addr := fmt.Sprintf("[::]:%d", p)
					if nw == "tcp" {
						l, err := net.Listen("tcp", addr)
						if err != nil {
							t.Fatal(err)
						}
						closers = append(closers, l.Close)
						continue
					}
					u, err := net.ListenPacket("udp", addr)
					if err != nil {
						t.Fatal(err)
					}
					closers = append(closers, u.Close)
				}
			}
		}
		for i, proto := range []uint8{protoTCP, protoUDP, protoTCP, protoUDP} {
			for j := range 10 {
				dst := netip.AddrFrom4([4]byte{198, 51, 100, byte(1 + i*10 + j)})
				f := flow{src: pod1, dst: dst, proto: proto, sport: uint16(20000 + j), dport: 443, tcpFlags: tcpSYN}
				if p := parse(t, e.egress(f.packet())); p.src != snat4 || p.sport != 40009 {
					t.Fatalf("proto %d flow %d left as %v:%d, want %v:40009 (40000-40008 are the node's)", proto, j, p.src, p.sport, snat4)
				}
			}
		}
		// IPv6: 40000 and 40001 are held by [::] sockets.
		if err := e.dp.SetPortRange(40000, 40001); err != nil {
			t.Fatal(err)
		}
		before := e.counters()
		f6 := flow{src: pod6, dst: remote6, proto: protoUDP, sport: 20000, dport: 53}
		if ret, out := e.run(e.dp.Egress, f6.packet()); ret != tcActShot {
			p := parse(t, out)
			t.Fatalf("IPv6 flow with both ports of the range held by node sockets: verdict %d (%v:%d), want a drop", int32(ret), p.src, p.sport)
		}
		e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})
		l, err := net.Listen("tcp4", "0.0.0.0:40009")
		if err != nil {
			t.Fatal(err)
		}
		closers = append(closers, l.Close)
		if err := e.dp.SetPortRange(40000, 40009); err != nil {
			t.Fatal(err)
		}
		before = e.counters()
		f := flow{src: pod2, dst: remote4, proto: protoTCP, sport: 20000, dport: 443, tcpFlags: tcpSYN}
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
			t.Fatalf("every port of the range a node socket's: verdict %d, want a drop", int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})
	})
}

// TestNodeFlowRemappedInRange: a node connection whose port (chosen by its
// kernel in the NAT range, which nothing reserves) a pod's pair holds
// toward the same remote is given another port of the range, both ways,
// and the pod's flow carries on: the node's reply reaches the node's
// socket's port, the pod's the pod.
func TestNodeFlowRemappedInRange(t *testing.T) {
	inFreshNetns(t, func() {
		e := newEnv(t, envOptions{portMin: 40000, portMax: 40001})
		if err := e.dp.Maps.NodeAddrsV4.Put(snat4.As4(), uint8(1)); err != nil {
			t.Fatal(err)
		}
		pod := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 20000, dport: 443, tcpFlags: tcpSYN}
		held := parse(t, e.egress(pod.packet())).sport
		other := uint16(40000 + 40001 - int(held))

		node := flow{src: snat4, dst: remote4, proto: protoTCP, sport: held, dport: 443, tcpFlags: tcpSYN}
		before := e.counters()
		if p := parse(t, e.egress(node.packet())); p.src != snat4 || p.sport != other {
			t.Fatalf("node flow on the pod's port %d left as %v:%d, want %v:%d", held, p.src, p.sport, snat4, other)
		}
		e.checkCounters(before, map[Counter]uint64{CounterMasqueraded: 1, CounterHostFlowRemapped: 1})
		if p := parse(t, e.ingress(reply(node, snat4, other).packet())); p.dst != snat4 || p.dport != held {
			t.Fatalf("the node flow's reply went to %v:%d, want %v:%d", p.dst, p.dport, snat4, held)
		}
		if p := parse(t, e.ingress(reply(pod, snat4, held).packet())); p.dst != pod1 || p.dport != 20000 {
			t.Fatalf("the pod's reply went to %v:%d, want %v:20000", p.dst, p.dport, pod1)
		}
	})
}

// TestRandomFully: MASQUERADE --random-fully never keeps a flow's own port
// by right: with --nat-random-fully a flow whose own port is free gets a
// random one of its space (1024-65535 with ports kept, the NAT range
// otherwise), where without it the port is kept.
func TestRandomFully(t *testing.T) {
	inFreshNetns(t, func() {
		e := newEnv(t, envOptions{portMin: 40000, portMax: 40999})
		for _, tc := range []struct {
			keep, random bool
			min, max     uint16
			sport        uint16 // the first flow's own port
			maxOwn       int    // flows of 40 that may keep their own port
		}{
			// own port free: kept, as MASQUERADE (outside the range with
			// ports kept, inside it with --to-ports)
			{keep: true, random: false, min: 1024, max: 65535, sport: 45100, maxOwn: 40},
			{keep: false, random: false, min: 40000, max: 40999, sport: 40100, maxOwn: 40},
			// random: 40 draws over 64 512 (1 000) ports; two or more
			// on their own port: p < 1e-6 (7e-4)
			{keep: true, random: true, min: 1024, max: 65535, sport: 45100, maxOwn: 1},
			{keep: false, random: true, min: 40000, max: 40999, sport: 40100, maxOwn: 3},
		} {
			if err := e.dp.SetKeepSourcePort(tc.keep); err != nil {
				t.Fatal(err)
			}
			if err := e.dp.SetRandomFully(tc.random); err != nil {
				t.Fatal(err)
			}
			clearMap(t, e.dp.Maps.NatV4)
			own, ports := 0, map[uint16]bool{}
			for i := range 40 {
				sport := tc.sport + uint16(i)
				dst := netip.AddrFrom4([4]byte{198, 51, 100, byte(1 + i)})
				f := flow{src: pod1, dst: dst, proto: []uint8{protoTCP, protoUDP}[i%2], sport: sport, dport: 443, tcpFlags: tcpSYN}
				p := parse(t, e.egress(f.packet()))
				if p.src != snat4 || p.sport < tc.min || p.sport > tc.max {
					t.Fatalf("keep %v random %v: flow %d left as %v:%d, want %v and a port of %d-%d", tc.keep, tc.random, i, p.src, p.sport, snat4, tc.min, tc.max)
				}
				if p.sport == sport {
					own++
				}
				ports[p.sport] = true
			}
			if !tc.random && own != 40 {
				t.Errorf("keep %v: %d of 40 flows kept their free own port, want all", tc.keep, own)
			}
			if tc.random && (own > tc.maxOwn || len(ports) < 30) {
				t.Errorf("keep %v random: %d of 40 flows on their own port (at most %d), %d distinct ports", tc.keep, own, tc.maxOwn, len(ports))
			}
		}
		// ICMP ids and node flows come from the range either way.
		ping := flow{src: pod1, dst: remote4, proto: protoICMP, sport: 40100, icmpType: 8}
		if p := parse(t, e.egress(ping.packet())); p.sport < 40000 || p.sport > 40999 {
			t.Fatalf("echo id %d outside the range", p.sport)
		}
	})
}

// TestManyPortRanges: any number of ranges, overlapping or not (upstream's
// --to-ports takes them all): the datapath takes their union, and every
// port of it, and no other, is given.
func TestManyPortRanges(t *testing.T) {
	inFreshNetns(t, func() {
		e := newEnv(t, envOptions{natMax: 4096})
		var ranges [][2]uint16
		want := map[uint16]bool{}
		for i := range 12 {
			p := uint16(2000 + 100*i)
			ranges = append(ranges, [2]uint16{p, p})
			want[p] = true
		}
		// overlapping, out of order
		ranges = append(ranges, [2]uint16{30005, 30009}, [2]uint16{30000, 30006})
		for p := uint16(30000); p <= 30009; p++ {
			want[p] = true
		}
		if err := e.dp.SetPortRanges(ranges); err != nil {
			t.Fatal(err)
		}
		got := map[uint16]bool{}
		for i := range len(want) {
			f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: uint16(20000 + i), dport: 53}
			p := parse(t, e.egress(f.packet()))
			if !want[p.sport] || got[p.sport] {
				t.Fatalf("flow %d got port %d: not in the union, or given twice (%v)", i, p.sport, got)
			}
			got[p.sport] = true
		}
		before := e.counters()
		f := flow{src: pod2, dst: remote4, proto: protoUDP, sport: 20000, dport: 53}
		if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActShot {
			t.Fatalf("every port of the union held toward the destination: verdict %d, want a drop", int32(ret))
		}
		e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})
		// A flow's own port of the union is kept (Linux keeps a port in
		// its rule's range), one outside it is not.
		clearMap(t, e.dp.Maps.NatV4)
		kept := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 2300, dport: 443, tcpFlags: tcpSYN}
		fromSNATPort(t, e.egress(kept.packet()), snat4, 2300)
		notIn := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 2301, dport: 443, tcpFlags: tcpSYN}
		if p := parse(t, e.egress(notIn.packet())); !want[p.sport] {
			t.Fatalf("own port 2301 outside the union: got %d", p.sport)
		}
	})
}

// TestEchoIDsIgnoreSockets: an ICMP echo id is no socket's: a UDP socket of
// the node on the range's one port does not keep a pod's ping from it.
func TestEchoIDsIgnoreSockets(t *testing.T) {
	inFreshNetns(t, func() {
		e := newEnv(t, envOptions{portMin: 40000, portMax: 40000})
		u, err := net.ListenPacket("udp4", "0.0.0.0:40000")
		if err != nil {
			t.Fatal(err)
		}
		defer u.Close()
		ping := flow{src: pod1, dst: remote4, proto: protoICMP, sport: 7, icmpType: 8}
		if p := parse(t, e.egress(ping.packet())); p.src != snat4 || p.sport != 40000 {
			t.Fatalf("echo request left as %v id %d, want %v id 40000", p.src, p.sport, snat4)
		}
	})
}
