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
	d := &Datapath{Egress: coll.Programs["ipmasq_egress"], Ingress: coll.Programs["ipmasq_ingress"]}
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
// on the baseline build, as sub-benchmarks of one run.
func benchObjects(b *testing.B, o envOptions, bench func(b *testing.B, e *testEnv)) {
	b.Run("current", func(b *testing.B) { bench(b, newEnv(b, o)) })
	if *baselineObject != "" {
		o.object = *baselineObject
		b.Run("baseline", func(b *testing.B) { bench(b, newEnv(b, o)) })
	}
}
