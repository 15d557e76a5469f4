package bpf

import (
	"net/netip"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// natPair returns the listed pair of egress tuple f, if any.
func (e *testEnv) natPair(f flow) (NATPair, bool) {
	e.tb.Helper()
	var out NATPair
	found := false
	err := ReadNATPairsV4(e.dp.Maps.NatV4, func(p *NATPair) bool {
		if p.Kind == KindMasquerade && p.Src == netip.AddrPortFrom(f.src, f.sport) && p.Dst == netip.AddrPortFrom(f.dst, f.dport) {
			out, found = *p, true
			return false
		}
		return true
	})
	if err != nil {
		e.tb.Fatal(err)
	}
	return out, found
}

func egressKey(f flow) NATKeyV4 {
	return NATKeyV4{Src: Addr4(f.src), Dst: Addr4(f.dst), Sport: Port(f.sport), Dport: Port(f.dport), Proto: f.proto, Dir: DirEgress}
}

// TestMarkConntrack: a pair marked as handed to conntrack is listed as
// such (the handover then leaves it alone); a tuple without a pair is
// reported gone.
func TestMarkConntrack(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	masqueraded(t, e.egress(f.packet()), f, snat4)
	if p, ok := e.natPair(f); !ok || p.Conntrack {
		t.Fatalf("a new pair: %+v (listed %v), want not conntrack's", p, ok)
	}
	if res, err := e.dp.MarkConntrackV4(egressKey(f)); err != nil || res != HandoverDone {
		t.Fatalf("mark: %v %v", res, err)
	}
	if p, ok := e.natPair(f); !ok || !p.Conntrack {
		t.Fatalf("a marked pair: %+v (listed %v), want conntrack's", p, ok)
	}
	other := f
	other.sport = 40001
	if res, err := e.dp.MarkConntrackV4(egressKey(other)); err != nil || res != HandoverGone {
		t.Fatalf("mark a tuple without a pair: %v %v, want gone", res, err)
	}
}

// TestAdoptTakesTheTupleConntrackChose: conntrack translates a flow to a
// tuple it does not know the datapath holds; the adopted pair replaces the
// holder (a node flow's hold, or an older pair, whose egress entry goes
// too) and the counts stay exact.
func TestAdoptTakesTheTupleConntrackChose(t *testing.T) {
	e := newEnv(t, envOptions{})
	// An older pair of pod2, translated to snat4:port.
	old := flow{src: pod2, dst: remote4, proto: protoUDP, sport: 5000, dport: 53, payload: []byte("q")}
	port := masqueraded(t, e.egress(old.packet()), old, snat4)
	// conntrack translated pod1's flow to the same tuple.
	f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: 6000, dport: 53}
	if res, err := e.dp.AdoptV4(egressKey(f), snat4, port, true); err != nil || res != HandoverDone {
		t.Fatalf("adopt: %v %v", res, err)
	}
	if _, ok := e.natPair(old); ok {
		t.Fatal("the older pair is still listed: its egress entry would send from the adopted tuple")
	}
	p, ok := e.natPair(f)
	if !ok || !p.Conntrack || p.Translated != netip.AddrPortFrom(snat4, port) || p.Flags&NATFlagSeen == 0 {
		t.Fatalf("the adopted pair: %+v (listed %v)", p, ok)
	}
	// The reply to the tuple goes to pod1 (no conntrack entry holds it in
	// this namespace).
	r := parse(t, e.ingress(reply(f, snat4, port).packet()))
	if r.dst != pod1 || r.dport != 6000 {
		t.Fatalf("the reply went to %v:%d, want %v:6000", r.dst, r.dport, pod1)
	}
	// Adopting it again finds it.
	if res, err := e.dp.AdoptV4(egressKey(f), snat4, port, true); err != nil || res != HandoverExists {
		t.Fatalf("adopt again: %v %v, want exists", res, err)
	}
	// The counts are the map's.
	c, err := CountNATEntries(e.dp.Maps.NatV4, false)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ReadNATCounts(e.dp.Maps.NatCount)
	if err != nil {
		t.Fatal(err)
	}
	c.Family = got[0].Family
	if got[0] != c {
		t.Fatalf("nat_count says %+v, the map holds %+v", got[0], c)
	}
}

// TestLoadClearsHandBackNotes: the notes of a hand-back an agent was
// stopped in are gone after the next load (pinned maps are reused), so
// that no reply of a noted flow is dropped for good.
func TestLoadClearsHandBackNotes(t *testing.T) {
	privtest.Require(t)
	pinDir := filepath.Join(privtest.MountBPFFS(t), "ipmasq")
	dp, err := Load(LoadOptions{PinDir: pinDir, NATMaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	if err := dp.NoteHandBackV4(egressKey(f), 50000); err != nil {
		t.Fatal(err)
	}
	k6 := NATKeyV6{Src: netip.MustParseAddr("fd00:244::2").As16(), Dst: netip.MustParseAddr("2001:db8::10").As16(), Sport: Port(40000), Dport: Port(443), Proto: protoTCP}
	if err := dp.NoteHandBackV6(k6, 50000); err != nil {
		t.Fatal(err)
	}
	dp.Close() // as an agent killed during a hand-back leaves them

	dp, err = Load(LoadOptions{PinDir: pinDir, NATMaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	var active uint32
	if err := dp.Maps.HandbackActive.Lookup(uint32(0), &active); err != nil || active != 0 {
		t.Errorf("handback_active after the load: %d (%v), want 0", active, err)
	}
	for _, m := range []*ebpf.Map{dp.Maps.HandbackV4, dp.Maps.HandbackV6} {
		var key, val []byte
		if it := m.Iterate(); it.Next(&key, &val) {
			t.Errorf("%s after the load holds a note (key %x), want none", m, key)
		}
	}
}

// TestHandBackFlagReachesEveryProgram: the hand-back's flag
// (handback_active, lib/handover.h: handback_on) is read by every tc
// program, those of an earlier load too: an agent that starts again loads
// new programs while the old ones are still attached (until the replace),
// and the flag it writes must gate their checks as well. So it is the
// pinned map both loads share, not a global variable of each object.
func TestHandBackFlagReachesEveryProgram(t *testing.T) {
	privtest.Require(t)
	pinDir := filepath.Join(privtest.MountBPFFS(t), "ipmasq")
	var loads []*Datapath
	for range 2 {
		dp, err := Load(LoadOptions{PinDir: pinDir, NATMaxEntries: 1024})
		if err != nil {
			t.Fatal(err)
		}
		defer dp.Close()
		loads = append(loads, dp)
	}
	cur := loads[1]
	flag, err := mapID(cur.Maps.HandbackActive)
	if err != nil {
		t.Fatal(err)
	}
	if old, err := mapID(loads[0].Maps.HandbackActive); err != nil || old != flag {
		t.Fatalf("handback_active of the first load is map %d (%v), of the second %d: want the same", old, err, flag)
	}
	if err := cur.NoteHandBackV4(egressKey(flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}), 50000); err != nil {
		t.Fatal(err)
	}
	var on uint32
	if err := loads[0].Maps.HandbackActive.Lookup(uint32(0), &on); err != nil || on == 0 {
		t.Fatalf("handback_active as the first load reads it after the second's note: %d (%v), want non-zero", on, err)
	}
	for i, dp := range loads {
		egressL3, ingressL3, err := dp.ProgramsL3()
		if err != nil {
			t.Fatal(err)
		}
		for name, prog := range map[string]*ebpf.Program{
			"ipmasq_egress": dp.Egress, "ipmasq_ingress": dp.Ingress,
			"ipmasq_egress_l3": egressL3, "ipmasq_ingress_l3": ingressL3,
		} {
			info, err := prog.Info()
			if err != nil {
				t.Fatal(err)
			}
			ids, ok := info.MapIDs()
			if !ok {
				t.Fatalf("load %d %s: the kernel lists no map IDs", i+1, name)
			}
			if !slices.Contains(ids, flag) {
				t.Errorf("load %d %s: maps %v, want the pinned handback_active (%d) among them", i+1, name, ids, flag)
			}
		}
	}
}
