package bpf

import (
	"math/rand/v2"
	"net/netip"
	"testing"
)

// TestReplyIndex: the listing's index finds every key put into it with its
// last value, finds no other, through growth from its smallest size and
// with every key on one hash (all in one probe run).
func TestReplyIndex(t *testing.T) {
	for _, c := range []struct {
		name string
		hash func(NATKeyV4) uint64
		n    int
	}{
		{"hashNATKeyV4", hashNATKeyV4, 50000},
		{"one hash for all", func(NATKeyV4) uint64 { return 7 }, 300},
	} {
		t.Run(c.name, func(t *testing.T) {
			x := newReplyIndex(0, c.hash)
			key := func(i int) NATKeyV4 {
				return NATKeyV4{Src: Addr4(netip.AddrFrom4([4]byte{198, 18, byte(i >> 16), 7})), Dst: Addr4(netip.MustParseAddr("10.0.0.5")),
					Sport: Port(443), Dport: Port(uint16(i)), Proto: protoTCP, Dir: DirIngress}
			}
			for i := range c.n {
				x.put(key(i), replyInfo{flags: 1, lastSeen: uint64(i)})
			}
			for i := 0; i < c.n; i += 3 {
				x.put(key(i), replyInfo{flags: NATFlagSeen, lastSeen: uint64(i) + 1})
			}
			if x.n != c.n {
				t.Fatalf("%d entries, want %d", x.n, c.n)
			}
			for _, i := range rand.Perm(c.n) {
				want := replyInfo{flags: 1, lastSeen: uint64(i)}
				if i%3 == 0 {
					want = replyInfo{flags: NATFlagSeen, lastSeen: uint64(i) + 1}
				}
				if got, ok := x.get(key(i)); !ok || got != want {
					t.Fatalf("key %d: got %+v %v, want %+v", i, got, ok, want)
				}
			}
			for i := c.n; i < c.n+100; i++ {
				if got, ok := x.get(key(i)); ok {
					t.Fatalf("key %d never put: found %+v", i, got)
				}
			}
			if 2*x.n > len(x.slots) {
				t.Errorf("%d entries in %d slots: more than half full", x.n, len(x.slots))
			}
		})
	}
}
