package bpf

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// TestNATCountsUnderRaces: after SYNs of many sources on every CPU race
// for 4 NAT ports in a map too small for them (pairs reopened, ports taken
// over, early drop making room, new flows refused) against a collector
// ending pairs (TestNoRaces's scenario), the programs' counts
// (nat_count) equal a full walk of each NAT map, class by class.
func TestNATCountsUnderRaces(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		name := "ipv4"
		if v6 {
			name = "ipv6"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, envOptions{portMin: 61000, portMax: 61255, natMax: 96})
			if err := e.dp.SetKeepSourcePort(false); err != nil {
				t.Fatal(err)
			}
			l := DefaultLifetimes
			l.TCPSyn = 20 * time.Microsecond
			if err := e.dp.SetLifetimes(l); err != nil {
				t.Fatal(err)
			}
			before := e.counters()
			check := func(m *ebpf.Map) []error {
				checkNATCounts(t, e.dp)
				return nil
			}
			if v6 {
				raceSYNs(t, e, true, e.dp.EndPairV6, check)
			} else {
				raceSYNs(t, e, false, e.dp.EndPairV4, check)
			}
			c := e.counters()
			if c[CounterNATEarlyDrop] == before[CounterNATEarlyDrop] {
				t.Error("no early drop: the map never filled")
			}
		})
	}
}

// checkNATCounts fails the test when the programs' counts differ from a
// walk of the maps.
func checkNATCounts(t *testing.T, dp *Datapath) {
	t.Helper()
	counts, err := ReadNATCounts(dp.Maps.NatCount)
	if err != nil {
		t.Fatal(err)
	}
	for i, m := range []*ebpf.Map{dp.Maps.NatV4, dp.Maps.NatV6} {
		walk, err := CountNATEntries(m, i == 1)
		if err != nil {
			t.Fatal(err)
		}
		if counts[i] != walk {
			t.Errorf("%s: counted %+v, the map holds %+v", walk.Family, counts[i], walk)
		} else {
			t.Logf("%s: %+v", walk.Family, walk)
		}
	}
}

// TestNATCountsOfEveryKind: a masquerade pair, an inbound record and a node
// flow's hold, each made by its packet, are counted in their class, and the
// collector's end of each takes it out again.
func TestNATCountsOfEveryKind(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61999})
	if err := e.dp.Maps.NodeAddrsV4.Put(snat4.As4(), uint8(1)); err != nil {
		t.Fatal(err)
	}
	e.egress(flow{src: pod1, dst: remote4, proto: protoUDP, sport: 5000, dport: 53}.packet())
	e.ingress(flow{src: remote4, dst: pod1, proto: protoUDP, sport: 5353, dport: 7012}.packet())
	e.egress(flow{src: snat4, dst: remote4, proto: protoUDP, sport: 61500, dport: 53}.packet())
	counts, err := ReadNATCounts(e.dp.Maps.NatCount)
	if err != nil {
		t.Fatal(err)
	}
	if want := (NATCounts{Family: "ipv4", Masquerade: 1, Reply: 1, Inbound: 1, Host: 1}); counts[0] != want {
		t.Errorf("counted %+v, want %+v", counts[0], want)
	}
	checkNATCounts(t, e.dp)
	var k NATKeyV4
	var keys []NATKeyV4
	var v []byte
	for it := e.dp.Maps.NatV4.Iterate(); it.Next(&k, &v); {
		keys = append(keys, k)
	}
	for _, k := range keys {
		if _, err := e.dp.EndPairV4(k, true); err != nil {
			t.Fatal(err)
		}
	}
	checkNATCounts(t, e.dp)
	if counts, _ = ReadNATCounts(e.dp.Maps.NatCount); counts[0].Entries() != 0 {
		t.Errorf("after ending everything: %+v", counts[0])
	}
}

// TestNATCountsAcrossLoads: the counts follow the maps across loads: a
// restart that reuses the pinned maps keeps them (never recounted, so a
// restart under traffic changes nothing), a resize whose pairs are copied
// from user space recounts the new maps, and so does the first load with a
// count map (an upgrade: nat_count not pinned yet).
func TestNATCountsAcrossLoads(t *testing.T) {
	e := newEnv(t, envOptions{natMax: 64})
	e.egress(flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}.packet())
	e.egress(flow{src: pod6, dst: remote6, proto: protoUDP, sport: 40000, dport: 53}.packet())
	want := []NATCounts{{Family: "ipv4", Masquerade: 1, Reply: 1}, {Family: "ipv6", Masquerade: 1, Reply: 1}}
	reload := func(name string, size uint32) {
		t.Helper()
		dp, err := Load(LoadOptions{PinDir: e.pinDir, NATMaxEntries: size})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { dp.Close() })
		e.dp.Close()
		e.dp = dp
		counts, err := ReadNATCounts(dp.Maps.NatCount)
		if err != nil {
			t.Fatal(err)
		}
		if counts[0] != want[0] || counts[1] != want[1] {
			t.Errorf("%s: counts %+v, want %+v", name, counts, want)
		}
		checkNATCounts(t, dp)
	}
	reload("restart", 64)
	reload("resized", 4096)
	if err := os.Remove(filepath.Join(e.pinDir, MapNATCount)); err != nil {
		t.Fatal(err)
	}
	reload("upgrade (no count map pinned)", 4096)
}
