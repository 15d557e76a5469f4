package natgc

import (
	"net/netip"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/internal/testkit/privtest"
)

// pairV4Entries returns both entries of a NAT pair pod:sport → dst:dport
// translated to snat:natPort.
func pairEntries(proto uint8, pod, dst, snat string, sport, dport, natPort uint16, lastSeen uint64, flags uint8) map[bpf.NATKeyV4]bpf.NATValV4 {
	p, d, s := netip.MustParseAddr(pod), netip.MustParseAddr(dst), netip.MustParseAddr(snat)
	return map[bpf.NATKeyV4]bpf.NATValV4{
		{Src: bpf.Addr4(p), Dst: bpf.Addr4(d), Sport: bpf.Port(sport), Dport: bpf.Port(dport), Proto: proto, Dir: bpf.DirEgress}: {
			Addr: bpf.Addr4(s), Port: bpf.Port(natPort), LastSeenNs: lastSeen, Flags: flags},
		{Src: bpf.Addr4(d), Dst: bpf.Addr4(s), Sport: bpf.Port(dport), Dport: bpf.Port(natPort), Proto: proto, Dir: bpf.DirIngress}: {
			Addr: bpf.Addr4(p), Port: bpf.Port(sport), LastSeenNs: lastSeen},
	}
}

// loadDatapath loads the programs and their maps, unpinned, with the
// default lifetimes: the kernel judges each candidate again, by its own
// clock and the lifetimes the programs apply.
func loadDatapath(t *testing.T) *bpf.Datapath {
	t.Helper()
	privtest.Require(t)
	dp, err := bpf.Load(bpf.LoadOptions{NATMaxEntries: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	if err := dp.SetLifetimes(bpf.DefaultLifetimes); err != nil {
		t.Fatal(err)
	}
	return dp
}

func TestCollectExpiresIdlePairs(t *testing.T) {
	dp := loadDatapath(t)
	now := monotonicNow()
	ago := func(d time.Duration) uint64 { return now - uint64(d) }
	const node = "10.0.0.5"
	keep := map[string]map[bpf.NATKeyV4]bpf.NATValV4{
		"tcp open, idle 1h":    pairEntries(protoTCP, "10.244.1.2", "203.0.113.10", node, 1000, 80, 61000, ago(time.Hour), bpf.NATFlagSeen),
		"tcp open, idle 7h":    pairEntries(protoTCP, "10.244.1.2", "203.0.113.10", node, 1007, 80, 61007, ago(7*time.Hour), bpf.NATFlagSeen),
		"tcp syn, idle 50s":    pairEntries(protoTCP, "10.244.1.2", "203.0.113.10", node, 1003, 80, 61004, ago(50*time.Second), 0),
		"tcp reset, idle 5s":   pairEntries(protoTCP, "10.244.1.2", "203.0.113.10", node, 1004, 80, 61005, ago(5*time.Second), bpf.NATFlagRST|bpf.NATFlagSeen),
		"udp stream, idle 90s": pairEntries(protoUDP, "10.244.1.2", "203.0.113.10", node, 1005, 53, 61006, ago(90*time.Second), bpf.NATFlagSeen|bpf.NATFlagStream),
		"sctp, idle 5m":        pairEntries(protoSCTP, "10.244.1.2", "203.0.113.10", node, 1006, 38412, 1006, ago(5*time.Minute), 0),
		"gre, idle 5m":         pairEntries(47, "10.244.1.2", "203.0.113.11", node, 0, 0, 0, ago(5*time.Minute), 0),
		"tcp closed, idle 30s": pairEntries(protoTCP, "10.244.1.2", "203.0.113.10", node, 1001, 80, 61001, ago(30*time.Second), bpf.NATFlagFIN),
		"udp, idle 10s":        pairEntries(protoUDP, "10.244.1.2", "203.0.113.10", node, 1002, 53, 61002, ago(10*time.Second), 0),
		"icmp, idle 5s":        pairEntries(protoICMP, "10.244.1.2", "203.0.113.10", node, 7, 0, 61003, ago(5*time.Second), 0),
	}
	drop := map[string]map[bpf.NATKeyV4]bpf.NATValV4{
		"tcp open, idle 5 days":        pairEntries(protoTCP, "10.244.1.3", "203.0.113.10", node, 1000, 80, 62000, ago(121*time.Hour), bpf.NATFlagSeen),
		"tcp syn, idle 70s":            pairEntries(protoTCP, "10.244.1.3", "203.0.113.10", node, 1003, 80, 62004, ago(70*time.Second), 0),
		"udp one way, idle 40s":        pairEntries(protoUDP, "10.244.1.3", "203.0.113.10", node, 1004, 53, 62005, ago(40*time.Second), 0),
		"udp query answered, idle 40s": pairEntries(protoUDP, "10.244.1.3", "203.0.113.10", node, 1008, 53, 62006, ago(40*time.Second), bpf.NATFlagSeen),
		"sctp, idle 11m":               pairEntries(protoSCTP, "10.244.1.3", "203.0.113.10", node, 1007, 38412, 1007, ago(11*time.Minute), 0),
		"tcp closed, idle 3m":          pairEntries(protoTCP, "10.244.1.3", "203.0.113.10", node, 1001, 80, 62001, ago(3*time.Minute), bpf.NATFlagRST),
		"udp, idle 2m":                 pairEntries(protoUDP, "10.244.1.3", "203.0.113.10", node, 1002, 53, 62002, ago(2*time.Minute), 0),
		"icmp, idle 1m":                pairEntries(protoICMP, "10.244.1.3", "203.0.113.10", node, 7, 0, 62003, ago(time.Minute), 0),
		"fresh, but an old SNAT addr":  pairEntries(protoTCP, "10.244.1.4", "203.0.113.10", "10.0.0.99", 1000, 80, 63000, ago(time.Second), 0),
	}
	for _, set := range []map[string]map[bpf.NATKeyV4]bpf.NATValV4{keep, drop} {
		for _, pair := range set {
			for k, v := range pair {
				if err := dp.Maps.NatV4.Put(k, v); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	// One direction closed recently keeps the pair: both are judged together.
	pair := pairEntries(protoTCP, "10.244.1.5", "203.0.113.10", node, 1000, 80, 64000, ago(121*time.Hour), bpf.NATFlagSeen)
	for k, v := range pair {
		if k.Dir == bpf.DirIngress {
			v.LastSeenNs = ago(time.Minute)
		}
		dp.Maps.NatV4.Put(k, v)
	}
	keep["one direction recent"] = pair

	// Inbound flow records (one entry each) live by their own state.
	inbound := func(proto uint8, remotePort uint16, lastSeen uint64, flags uint8) map[bpf.NATKeyV4]bpf.NATValV4 {
		k := bpf.NATKeyV4{Src: bpf.Addr4(netip.MustParseAddr("10.244.1.9")), Dst: bpf.Addr4(netip.MustParseAddr("203.0.113.10")),
			Sport: bpf.Port(80), Dport: bpf.Port(remotePort), Proto: proto, Dir: bpf.DirInbound}
		if err := dp.Maps.NatV4.Put(k, bpf.NATValV4{LastSeenNs: lastSeen, Flags: flags}); err != nil {
			t.Fatal(err)
		}
		return map[bpf.NATKeyV4]bpf.NATValV4{k: {}}
	}
	keep["inbound tcp answered, idle 1h"] = inbound(protoTCP, 5000, ago(time.Hour), bpf.NATFlagSeen)
	drop["inbound tcp unanswered, idle 2m"] = inbound(protoTCP, 5001, ago(2*time.Minute), 0)

	// A pair that looks expired when scanned but sees a packet before it
	// is ended stays: the kernel judges it again.
	revived := pairEntries(protoUDP, "10.244.1.6", "203.0.113.10", node, 1000, 53, 64001, ago(time.Hour), 0)
	for k, v := range revived {
		dp.Maps.NatV4.Put(k, v)
	}
	keep["revived between scan and delete"] = revived
	end := func(k bpf.NATKeyV4, force bool) (bpf.GCResult, error) {
		if _, ok := revived[k]; ok {
			for k, v := range revived {
				if k.Dir == bpf.DirIngress {
					v.LastSeenNs = monotonicNow()
					dp.Maps.NatV4.Put(k, v)
				}
			}
		}
		return dp.EndPairV4(k, force)
	}

	stats, err := collectV4(dp.Maps.NatV4, end, bpf.DefaultLifetimes, func() uint64 { return now },
		map[netip.Addr]bool{netip.MustParseAddr(node): true})
	if err != nil {
		t.Fatal(err)
	}
	if want := len(drop); stats.Expired != want {
		t.Errorf("ended %d pairs and records, want %d", stats.Expired, want)
	}
	var v bpf.NATValV4
	for name, pair := range keep {
		for k := range pair {
			if err := dp.Maps.NatV4.Lookup(k, &v); err != nil {
				t.Errorf("%s: entry removed: %v", name, err)
			}
		}
	}
	for name, pair := range drop {
		for k := range pair {
			if err := dp.Maps.NatV4.Lookup(k, &v); err == nil {
				t.Errorf("%s: entry kept", name)
			}
		}
	}
}

// TestCollectKeepsPairTakenOver: a flow that takes over an expired pair's
// port between the collector's scan and its delete keeps its new entries
// (the kernel judges the key again; it used to be deleted by key).
func TestCollectKeepsPairTakenOver(t *testing.T) {
	dp := loadDatapath(t)
	now := monotonicNow()
	const node = "10.0.0.5"
	old := pairEntries(protoTCP, "10.244.1.2", "203.0.113.10", node, 1000, 80, 61000, now-uint64(2*time.Minute), 0)
	for k, v := range old {
		if err := dp.Maps.NatV4.Put(k, v); err != nil {
			t.Fatal(err)
		}
	}
	// The new flow: another pod, the same NAT port, the same reply key.
	taker := pairEntries(protoTCP, "10.244.1.3", "203.0.113.10", node, 2000, 80, 61000, monotonicNow(), 0)
	takenOver := false
	end := func(k bpf.NATKeyV4, force bool) (bpf.GCResult, error) {
		if !takenOver {
			takenOver = true
			for k := range old {
				if k.Dir == bpf.DirEgress {
					dp.Maps.NatV4.Delete(k)
				}
			}
			for k, v := range taker {
				if err := dp.Maps.NatV4.Put(k, v); err != nil {
					t.Fatal(err)
				}
			}
		}
		return dp.EndPairV4(k, force)
	}
	stats, err := collectV4(dp.Maps.NatV4, end, bpf.DefaultLifetimes, func() uint64 { return now + 1 }, nil)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Expired != 0 {
		t.Errorf("ended %d pairs, want 0", stats.Expired)
	}
	var v bpf.NATValV4
	for k := range taker {
		if err := dp.Maps.NatV4.Lookup(k, &v); err != nil {
			t.Errorf("the new flow's dir-%d entry: %v", k.Dir, err)
		}
	}
}

// TestShortestLifetimeCoversEveryReachableState: adding one flag at a time
// reaches the shortest lifetime that any set of added flags reaches.
func TestShortestLifetimeCoversEveryReachableState(t *testing.T) {
	l := bpf.DefaultLifetimes
	l.TCPReset = time.Second // the shortest of all, so that it must be found
	for _, proto := range []uint8{protoTCP, protoUDP, bpf.ProtoICMP, 132} {
		for flags := range 256 {
			want := time.Duration(1<<63 - 1)
			for extra := range 256 {
				want = min(want, l.Of(bpf.StateOf(proto, uint8(flags|extra))))
			}
			if got := shortestLifetime(l, proto, uint8(flags)); got != want {
				t.Errorf("proto %d flags %#x: %v, want %v", proto, flags, got, want)
			}
		}
	}
}
