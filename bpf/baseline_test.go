package bpf

import (
	"flag"
	"reflect"
	"testing"

	"github.com/cilium/ebpf"
)

// baselineObject is an older build of masq.c, e.g. main's
// (git show main:bpf/masq_bpfel.o > /tmp/base.o), that the benchmarks also
// run in the same process, so that a change's per-packet cost is measured
// against it on the same machine at the same time.
var baselineObject = flag.String("bpf.baseline", "", "an older masq_bpfel.o the benchmarks also run, as a same-run baseline")

// loadObject loads another build of the programs, unpinned, as a Datapath:
// the maps both builds have are assigned by name, the others stay nil.
func loadObject(tb testing.TB, path string, natMax uint32) *Datapath {
	tb.Helper()
	spec, err := ebpf.LoadCollectionSpec(path)
	if err != nil {
		tb.Fatal(err)
	}
	if natMax == 0 {
		natMax = DefaultNATMaxEntries
	}
	spec.Maps[MapNATV4].MaxEntries = natMax
	spec.Maps[MapNATV6].MaxEntries = natMax
	// The rest as Load sets it, where the object has it: the records'
	// LRU sized to the NAT map, the nonmasq tries as newEnv asks, the
	// compat build's clock, the handover's conntrack lookup.
	for _, m := range []string{MapUnmasqV4, MapUnmasqV6} {
		if s, ok := spec.Maps[m]; ok {
			s.MaxEntries = UnmasqEntries(natMax)
		}
	}
	for _, m := range []string{MapNonMasqV4, MapNonMasqV6} {
		spec.Maps[m].MaxEntries = 100
	}
	set := func(name string, v any) {
		if s, ok := spec.Variables[name]; ok {
			if err := s.Set(v); err != nil {
				tb.Fatalf("%s: set %s: %v", path, name, err)
			}
		}
	}
	if !csumIPv6FlagSupported() {
		set("csum_ipv6_flag", uint64(0))
	}
	if hasCoarseClock() {
		set("compat_coarse_clock", uint32(1))
	}
	if ok, _ := ConntrackLookupAvailable(); ok {
		set("conntrack_lookup", uint32(1))
	}
	// An object with early drop's notes by hash gets them sized as Load
	// sizes them (else 4 096 slots whatever the table).
	if _, ok := spec.Variables["nat_note_slots_v4"]; ok {
		if err := sizeNotes(spec); err != nil {
			tb.Fatal(err)
		}
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		tb.Fatalf("load %s: %v", path, err)
	}
	tb.Cleanup(coll.Close)
	d := &Datapath{Egress: coll.Programs["ipmasq_egress"], Ingress: coll.Programs["ipmasq_ingress"], Variant: VariantFull}
	// The compat build's agent programs are tc programs (runAgentProgram).
	if p := coll.Programs["nat_gc_v4"]; p != nil && p.Type() == ebpf.SchedCLS {
		d.Variant = VariantCompat
	}
	d.l3.egress, d.l3.ingress = coll.Programs["ipmasq_egress_l3"], coll.Programs["ipmasq_ingress_l3"]
	maps := reflect.ValueOf(&d.objs.masqMaps).Elem()
	for i := range maps.NumField() {
		if m, ok := coll.Maps[maps.Type().Field(i).Tag.Get("ebpf")]; ok {
			maps.Field(i).Set(reflect.ValueOf(m))
		}
	}
	d.Maps = d.objs.masqMaps
	// The collector's programs too (EndPairV4/V6), where the object has
	// them; the collection owns them all (closing twice is harmless).
	progs := reflect.ValueOf(&d.objs.masqPrograms).Elem()
	for i := range progs.NumField() {
		if p, ok := coll.Programs[progs.Type().Field(i).Tag.Get("ebpf")]; ok {
			progs.Field(i).Set(reflect.ValueOf(p))
		}
	}
	d.objs.masqMaps = masqMaps{}
	return d
}

// benchObjects runs bench on the embedded build and, with -bpf.baseline,
// on the baseline build, as sub-benchmarks of one run: all of one's runs,
// then all of the other's. The per-packet benchmarks interleave the two
// instead (benchInterleaved).
func benchObjects(b *testing.B, o envOptions, bench func(b *testing.B, e *testEnv)) {
	b.Run("current", func(b *testing.B) { bench(b, newEnv(b, o)) })
	if *baselineObject != "" {
		o.object = *baselineObject
		b.Run("baseline", func(b *testing.B) { bench(b, newEnv(b, o)) })
	}
}

// measureFunc runs one path n more times on the object it was set up on
// and returns the kernel's time for those n runs, in ns.
type measureFunc func(n int) float64

// interleaveChunk is how many runs of one object benchInterleaved makes
// before it turns to the other.
const interleaveChunk = 4096

// benchInterleaved sets the path up on the embedded build (setup returns
// how to measure it) and, with -bpf.baseline, on the baseline build too,
// then spends b.N runs on each in alternating chunks of interleaveChunk
// runs, the pair's order swapped every chunk, so that a load that changes
// during the benchmark weighs on both objects alike. It reports ns/pkt
// (the embedded build's time per run), and with a baseline
// baseline-ns/pkt and their ratio x-baseline.
func benchInterleaved(b *testing.B, o envOptions, setup func(b *testing.B, e *testEnv) measureFunc) {
	objs := []measureFunc{setup(b, newEnv(b, o))}
	if *baselineObject != "" {
		o.object = *baselineObject
		objs = append(objs, setup(b, newEnv(b, o)))
	}
	total := make([]float64, len(objs))
	b.ResetTimer()
	for done, round := 0, 0; done < b.N; done, round = done+interleaveChunk, round+1 {
		n := min(interleaveChunk, b.N-done)
		for i := range objs {
			j := (i + round) % len(objs)
			total[j] += objs[j](n)
		}
	}
	b.StopTimer()
	b.ReportMetric(total[0]/float64(b.N), "ns/pkt")
	if len(objs) > 1 {
		b.ReportMetric(total[1]/float64(b.N), "baseline-ns/pkt")
		b.ReportMetric(total[0]/total[1], "x-baseline")
	}
}
