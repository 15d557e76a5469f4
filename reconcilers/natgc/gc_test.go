package natgc

import (
	"net/netip"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/testkit/privtest"
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
	now := bpf.KtimeNow()
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
					v.LastSeenNs = bpf.KtimeNow()
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
	now := bpf.KtimeNow()
	const node = "10.0.0.5"
	old := pairEntries(protoTCP, "10.244.1.2", "203.0.113.10", node, 1000, 80, 61000, now-uint64(2*time.Minute), 0)
	for k, v := range old {
		if err := dp.Maps.NatV4.Put(k, v); err != nil {
			t.Fatal(err)
		}
	}
	// The new flow: another pod, the same NAT port, the same reply key.
	taker := pairEntries(protoTCP, "10.244.1.3", "203.0.113.10", node, 2000, 80, 61000, bpf.KtimeNow(), 0)
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

// TestExpiredPairHasACandidateHalf: whatever the flags and last packets
// of a pair's two halves, when the pair has expired (judged as the kernel
// does: both halves' flags, the later stamp) one of its halves is a
// candidate by itself (candidateEntry), so the scan, which reads no other
// half, finds it; an egress entry alone (its reply entry lost) is one
// once past its protocol's longest lifetime.
func TestExpiredPairHasACandidateHalf(t *testing.T) {
	l := bpf.DefaultLifetimes
	now := uint64(100 * time.Hour)
	var ages []uint64
	for _, d := range []time.Duration{0, 5 * time.Second, 11 * time.Second, 31 * time.Second, 61 * time.Second,
		121 * time.Second, 5 * time.Minute, 11 * time.Minute, 7 * time.Hour, 6 * 24 * time.Hour} {
		ages = append(ages, now-uint64(d))
	}
	for _, proto := range []uint8{protoTCP, protoUDP, protoICMP, protoSCTP} {
		for fe := range 64 {
			for fr := range 64 {
				for _, le := range ages {
					for _, lr := range ages {
						last := max(le, lr)
						if !expiredAt(l, now, last, proto, uint8(fe|fr)) {
							continue
						}
						var longest longestLifetimes
						egress := natEntry{proto: proto, dir: bpf.DirEgress, flags: uint8(fe), lastSeen: le}
						reply := natEntry{proto: proto, dir: bpf.DirIngress, flags: uint8(fr), lastSeen: lr}
						if !candidateEntry(l, now, egress, &longest) && !candidateEntry(l, now, reply, &longest) {
							t.Fatalf("proto %d flags %#x/%#x idle %v/%v: the pair expired, neither half is a candidate",
								proto, fe, fr, time.Duration(now-le), time.Duration(now-lr))
						}
					}
				}
			}
		}
	}
}

// TestRoundIsBounded: a round reads at most its budget of entries (to the
// batch), the next one goes on from there, and the rounds together end
// every expired pair once the map has been read to its end.
func TestRoundIsBounded(t *testing.T) {
	privtest.Require(t)
	dp, err := bpf.Load(bpf.LoadOptions{NATMaxEntries: 1 << 15})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	if err := dp.SetLifetimes(bpf.DefaultLifetimes); err != nil {
		t.Fatal(err)
	}
	now := bpf.KtimeNow()
	const pairs = 5000 // 10 000 entries: 3 batches
	var (
		keys []bpf.NATKeyV4
		vals []bpf.NATValV4
	)
	for i := range pairs {
		pod := netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)})
		for k, v := range pairEntries(protoUDP, pod.String(), "203.0.113.10", "10.0.0.5", 1000, 53, uint16(1024+i), now-uint64(time.Hour), 0) {
			keys, vals = append(keys, k), append(vals, v)
		}
	}
	if _, err := dp.Maps.NatV4.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
	var s scanner[bpf.NATKeyV4, bpf.NATValV4]
	read, ended, rounds := 0, 0, 0
	for {
		st, err := s.round(dp.Maps.NatV4, bpf.MapNATV4, dp.EndPairV4, bpf.DefaultLifetimes, bpf.KtimeNow(), nil, describeV4, gcChunk)
		if err != nil {
			t.Fatal(err)
		}
		rounds++
		if st.Entries >= 2*gcChunk { // the budget, rounded up to a batch
			t.Fatalf("round %d read %d entries, budget %d", rounds, st.Entries, gcChunk)
		}
		read, ended = read+st.Entries, ended+st.Expired
		if st.Wrapped {
			break
		}
		if rounds > 10 {
			t.Fatal("no round reached the end of the map")
		}
	}
	// (Fewer than 3: a round ends both halves, the other often in a
	// bucket the next round would have read.)
	if rounds < 2 {
		t.Errorf("%d round for %d entries in batches of %d", rounds, 2*pairs, gcChunk)
	}
	if ended != pairs {
		t.Errorf("ended %d pairs in %d rounds (%d entries read), want %d", ended, rounds, read, pairs)
	}
	if n, _ := bpf.CountEntries[bpf.NATKeyV4, bpf.NATValV4](dp.Maps.NatV4); n != 0 {
		t.Errorf("%d entries left", n)
	}
}
