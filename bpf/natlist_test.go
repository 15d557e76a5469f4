package bpf

import (
	"net/netip"
	"testing"
)

// TestNATPairsJoinedAcrossBatches: the listing's one pass joins each pair
// to its reply entry wherever the two are in the map (in one batch or two,
// either first): every pair once, with both directions' flags and the
// later last packet; a pair whose reply entry is gone marked so; inbound
// records and node flow holds once each; an entry of no known direction
// not listed; and visit stopping the read.
func TestNATPairsJoinedAcrossBatches(t *testing.T) {
	const pairs = natListChunk + natListChunk/2 // three batches of entries
	e := newEnv(t, envOptions{natMax: 2*pairs + 64})
	snat := Addr4(netip.MustParseAddr("10.0.0.5"))
	var keys []NATKeyV4
	var vals []NATValV4
	want := map[netip.AddrPort]NATPair{}
	for i := range pairs {
		src := netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)})
		k := NATKeyV4{Src: Addr4(src), Dst: Addr4(remote4), Sport: Port(uint16(1024 + i%60000)), Dport: Port(443), Proto: protoTCP, Dir: DirEgress}
		v := NATValV4{Addr: snat, Port: Port(uint16(1024 + i%60000)), CreatedNs: 1000, LastSeenNs: 5000}
		keys, vals = append(keys, k), append(vals, v)
		p := NATPair{Kind: KindMasquerade, Proto: protoTCP, Src: netip.AddrPortFrom(src, 1024+uint16(i%60000)),
			Dst: netip.AddrPortFrom(remote4, 443), Translated: netip.AddrPortFrom(AddrFrom4(snat), 1024+uint16(i%60000)),
			CreatedNs: 1000, LastSeenNs: 5000}
		if i%7 == 0 {
			p.ReplyMissing = true
		} else {
			replySeen := uint64(4000 + 2*(i%1000)) // later than the egress entry's for some
			keys, vals = append(keys, PeerV4(k, v)), append(vals, NATValV4{Addr: k.Src, Port: k.Sport,
				Flags: NATFlagSeen | uint8(i%2)*NATFlagFIN, CreatedNs: 1000, LastSeenNs: replySeen})
			p.Flags = NATFlagSeen | uint8(i%2)*NATFlagFIN
			p.LastSeenNs = max(5000, replySeen)
		}
		p.State = StateOf(p.Proto, p.Flags)
		want[p.Src] = p
	}
	inbound := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(8080), Dport: Port(50000), Proto: protoTCP, Dir: DirInbound}
	hold := NATKeyV4{Src: Addr4(remote4), Dst: snat, Sport: Port(443), Dport: Port(33000), Proto: protoUDP, Dir: DirIngress}
	unknown := NATKeyV4{Src: Addr4(pod1), Dst: Addr4(remote4), Sport: Port(9), Dport: Port(9), Proto: protoUDP, Dir: 7}
	keys = append(keys, inbound, hold, unknown)
	vals = append(vals, NATValV4{Addr: Addr4(pod1), Port: Port(8080), CreatedNs: 5, LastSeenNs: 6},
		NATValV4{Addr: Addr4(host), Port: Port(33000), Flags: NATFlagHost, CreatedNs: 7, LastSeenNs: 8},
		NATValV4{CreatedNs: 9, LastSeenNs: 10})
	want[netip.AddrPortFrom(remote4, 50000)] = NATPair{Kind: KindInbound, Proto: protoTCP, Src: netip.AddrPortFrom(remote4, 50000),
		Dst: netip.AddrPortFrom(pod1, 8080), CreatedNs: 5, LastSeenNs: 6, State: StateOf(protoTCP, 0)}
	want[netip.AddrPortFrom(AddrFrom4(snat), 33000)] = NATPair{Kind: KindHost, Proto: protoUDP, Src: netip.AddrPortFrom(AddrFrom4(snat), 33000),
		Dst: netip.AddrPortFrom(remote4, 443), Flags: NATFlagHost, CreatedNs: 7, LastSeenNs: 8, State: StateOf(protoUDP, NATFlagHost)}
	if _, err := e.dp.Maps.NatV4.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}

	for _, hint := range []int{0, pairs} {
		seen := map[netip.AddrPort]bool{}
		err := readNATPairs(e.dp.Maps.NatV4, natV4, hint, func(p *NATPair) bool {
			w, ok := want[p.Src]
			switch {
			case !ok:
				t.Errorf("listed a record not in the map: %+v", *p)
			case seen[p.Src]:
				t.Errorf("listed twice: %+v", *p)
			case *p != w:
				t.Errorf("got  %+v\nwant %+v", *p, w)
			}
			seen[p.Src] = true
			return !t.Failed()
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(seen) != len(want) && !t.Failed() {
			t.Fatalf("index sized for %d: listed %d records, want %d", hint, len(seen), len(want))
		}
	}
	n := 0
	if err := readNATPairs(e.dp.Maps.NatV4, natV4, 0, func(*NATPair) bool { n++; return n < 3 }); err != nil || n != 3 {
		t.Errorf("visit stopped at 3: visited %d, %v", n, err)
	}
}
