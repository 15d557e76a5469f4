package bpf

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// TestStateOfIsNatState holds StateOf, the collector's reading of a pair's
// state, to nat_state() in lib/flow.h, the programs' own: every protocol
// and flags byte goes through nat_state() in the test program
// testdata/natstate.c (BPF_PROG_TEST_RUN), and both must name the same
// state. Every state must be reached, so that a state added in C without
// its inputs here fails too.
func TestStateOfIsNatState(t *testing.T) {
	privtest.Require(t)
	spec, err := ebpf.LoadCollectionSpec("testdata/natstate.o")
	if err != nil {
		t.Fatalf("%v (go generate ./bpf/ builds it)", err)
	}
	var objs struct {
		Prog *ebpf.Program `ebpf:"nat_state_of"`
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		t.Fatal(err)
	}
	defer objs.Prog.Close()

	reached := map[NATState]bool{}
	mismatches := 0
	frame := make([]byte, 14) // a test run wants an Ethernet header's length
	for proto := range 256 {
		for flags := range 256 {
			frame[0], frame[1] = uint8(proto), uint8(flags)
			ret, err := objs.Prog.Run(&ebpf.RunOptions{Data: frame})
			if err != nil {
				t.Fatal(err)
			}
			c := NATState(ret)
			reached[c] = true
			if got := StateOf(uint8(proto), uint8(flags)); got != c && mismatches < 10 {
				mismatches++
				t.Errorf("proto %d flags %#02x: StateOf says %s, nat_state() says %s", proto, flags, got, c)
			}
		}
	}
	for s := range numStates {
		if !reached[s] {
			t.Errorf("nat_state() never returned %s", s)
		}
	}
	if len(reached) != int(numStates) {
		t.Errorf("nat_state() returned %d distinct states, want the %d of enum nat_state", len(reached), numStates)
	}
}
