package bpf

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
)

// TestDevCountersActions: every program run ends in one action on its
// device, family and direction: the actions sum to the packets sent, a
// translated packet shows as translated in its direction, an untouched one
// as passed (non-IP frames under family "other"), a dropped one as dropped
// with its reason.
func TestDevCountersActions(t *testing.T) {
	e := newEnv(t, envOptions{})
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443}
	natPort := masqueraded(t, e.egress(f.packet()), f, snat4)                                   // egress ipv4 translated
	e.ingress(reply(f, snat4, natPort).packet())                                                // ingress ipv4 translated
	e.egress(flow{src: host, dst: remote4, proto: protoUDP, sport: 40000, dport: 53}.packet())  // egress ipv4 passed
	e.egress(flow{src: snat6, dst: remote6, proto: protoUDP, sport: 40000, dport: 53}.packet()) // egress ipv6 passed
	arp := make([]byte, 14+28)
	arp[12], arp[13] = 0x08, 0x06
	e.egress(arp) // egress other passed
	if err := e.dp.SetEgressDevice(loIfindex, netip.Addr{}, snat6); err != nil {
		t.Fatal(err)
	}
	g := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40100, dport: 443}
	if ret, _ := e.run(e.dp.Egress, g.packet()); ret != tcActShot { // egress ipv4 dropped, no-snat-address
		t.Fatalf("verdict %d, want TC_ACT_SHOT", int32(ret))
	}

	devs, err := ReadDevCounters(e.dp.Maps.DevCounters)
	if err != nil {
		t.Fatal(err)
	}
	type key struct{ family, dir string }
	got := map[key]DevCounters{}
	total := uint64(0)
	for _, d := range devs {
		if d.Ifindex != loIfindex {
			t.Errorf("counters of ifindex %d, want only %d: %+v", d.Ifindex, loIfindex, d)
		}
		got[key{d.Family, d.Direction}] = d
		for _, n := range d.Packets {
			total += n
		}
	}
	if total != 6 {
		t.Errorf("actions sum to %d, want the 6 packets sent: %+v", total, devs)
	}
	var noSNAT [NumDropReasons]uint64
	noSNAT[DropNoSNATAddress] = 1
	for k, want := range map[key]DevCounters{
		{"ipv4", "egress"}:  {Packets: [NumActions]uint64{ActionPassed: 1, ActionTranslated: 1, ActionDropped: 1}, Drops: noSNAT},
		{"ipv4", "ingress"}: {Packets: [NumActions]uint64{ActionTranslated: 1}},
		{"ipv6", "egress"}:  {Packets: [NumActions]uint64{ActionPassed: 1}},
		{"other", "egress"}: {Packets: [NumActions]uint64{ActionPassed: 1}},
	} {
		d := got[k]
		if d.Packets != want.Packets || d.Drops != want.Drops {
			t.Errorf("%s %s: packets %v drops %v, want %v %v", k.family, k.dir, d.Packets, d.Drops, want.Packets, want.Drops)
		}
	}
	if len(got) != 4 {
		t.Errorf("%d device/family/direction keys, want 4: %+v", len(got), devs)
	}
}

func TestDropReasonNames(t *testing.T) {
	seen := map[string]bool{}
	for r := DropReason(0); r < NumDropReasons; r++ {
		if r.String() == "" || seen[r.String()] {
			t.Errorf("reason %d: name %q (seen: %v)", r, r, seen[r.String()])
		}
		seen[r.String()] = true
	}
	if ActionPassed.String() != "passed" || ActionTranslated.String() != "translated" || ActionDropped.String() != "dropped" {
		t.Error("action names")
	}
}

// TestDevCountersInBatches: the batched read of dev_counters (the scrape's)
// returns what an entry-by-entry read does, over several batches.
func TestDevCountersInBatches(t *testing.T) {
	e := newEnv(t, envOptions{})
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 300 {
		k := masqDevCounterKey{Ifindex: uint32(100 + i/6), Family: uint8(i % 3), Dir: uint8(i/3) % 2}
		vals := make([]masqDevCounterVal, cpus)
		for c := range vals {
			vals[c].Packets[ActionTranslated] = uint64(i*10 + c)
			vals[c].Drops[DropNoPort] = uint64(i + c)
		}
		if err := e.dp.Maps.DevCounters.Put(k, vals); err != nil {
			t.Fatal(err)
		}
	}
	// The batches themselves (ReadDevCounters falls back to an entry by
	// entry read where the kernel has none): 300 entries in batches of 64.
	if b, err := readDevCounterBatches(e.dp.Maps.DevCounters, 64, cpus); err != nil || len(b) != 300 {
		t.Fatalf("batches of 64: %d entries, %v", len(b), err)
	}
	got, err := ReadDevCounters(e.dp.Maps.DevCounters)
	if err != nil {
		t.Fatal(err)
	}
	want, err := readDevCountersByKey(e.dp.Maps.DevCounters)
	if err != nil {
		t.Fatal(err)
	}
	key := func(d DevCounters) string { return fmt.Sprintf("%+v", d) }
	gs, ws := make([]string, 0, len(got)), make([]string, 0, len(want))
	for _, d := range got {
		gs = append(gs, key(d))
	}
	for _, d := range want {
		ws = append(ws, key(d))
	}
	slices.Sort(gs)
	slices.Sort(ws)
	if len(ws) != 300 || !slices.Equal(gs, ws) {
		t.Errorf("batched read: %d entries, entry by entry: %d (want 300 each, equal)", len(gs), len(ws))
	}
}
