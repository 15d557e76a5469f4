package bpf

import (
	"encoding/json"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// verifierStats is one program's load, as TestVerifierComplexity records
// it (the JSON of IPMASQ_VERIFIER_STATS).
type verifierStats struct {
	Variant Variant `json:"variant"`
	Program string  `json:"program"`
	// Insns is the verifier's count of instructions processed ("processed
	// N insns" of its log).
	Insns int `json:"insns"`
}

// verifierReport is the JSON written to IPMASQ_VERIFIER_STATS.
type verifierReport struct {
	Kernel   string          `json:"kernel"`
	Variants []Variant       `json:"variants"`
	Programs []verifierStats `json:"programs"`
}

var processedInsns = regexp.MustCompile(`processed (\d+) insns`)

// TestVerifierComplexity loads every program of every variant the running
// kernel can take, in the configuration that gives the verifier the most
// code (the conntrack lookup of lib/handover.h compiled in where the kernel
// has it, IPv6's checksum flag where it has that; the NAT maps as large as
// a test node can make them: a hash map's size does not enter the
// verification), and records per program the instructions the verifier
// processed. The compat variant loads on every kernel from 5.10, so it is
// loaded here whatever the kernel. With IPMASQ_VERIFIER_STATS set, the
// records go to that file as JSON (the VM harness collects them per
// kernel).
func TestVerifierComplexity(t *testing.T) {
	privtest.Require(t)
	f := ProbeKernel()
	variants := []Variant{VariantCompat}
	if len(f.MissingFull) == 0 {
		variants = append(variants, VariantFull)
	}
	if len(f.MissingCompat) > 0 {
		t.Fatalf("kernel %s: the compat variant cannot load: missing %v", f.Release, f.MissingCompat)
	}
	report := verifierReport{Kernel: f.Release, Variants: variants}
	for _, v := range variants {
		d, err := Load(LoadOptions{
			Variant:       v,
			NATMaxEntries: 1 << 20,
			// LogLevelStats: the count of processed instructions, also
			// where the kernel has no verified_insns (before 5.16).
			programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats},
		})
		if err != nil {
			t.Errorf("kernel %s, %s variant: %v", f.Release, v, err)
			continue
		}
		if d.Variant != v {
			t.Errorf("Load(Variant: %s) loaded %s", v, d.Variant)
		}
		// The L3 programs too: loaded at their first use.
		egressL3, ingressL3, err := d.ProgramsL3()
		if err != nil {
			t.Errorf("kernel %s, %s variant: %v", f.Release, v, err)
		}
		progs := reflect.ValueOf(d.objs.masqPrograms)
		for i := range progs.NumField() {
			name := progs.Type().Field(i).Tag.Get("ebpf")
			p := progs.Field(i).Interface().(*ebpf.Program)
			switch name {
			case "ipmasq_egress_l3":
				p = egressL3
			case "ipmasq_ingress_l3":
				p = ingressL3
			}
			if p == nil {
				t.Errorf("%s variant: program %s not loaded", v, name)
				continue
			}
			m := processedInsns.FindStringSubmatch(p.VerifierLog)
			if m == nil {
				t.Errorf("%s variant: program %s: no \"processed N insns\" in the verifier's log %q", v, name, p.VerifierLog)
				continue
			}
			n, _ := strconv.Atoi(m[1])
			report.Programs = append(report.Programs, verifierStats{Variant: v, Program: name, Insns: n})
			t.Logf("kernel %s, %s variant: %s: %d insns processed", f.Release, v, name, n)
		}
		d.Close()
	}
	// Both variants have the same programs, the agent's by the same names.
	if n := len(report.Programs); !t.Failed() && n != len(variants)*reflect.TypeOf(masqPrograms{}).NumField() {
		t.Errorf("%d programs recorded for %d variants", n, len(variants))
	}
	slices.SortFunc(report.Programs, func(a, b verifierStats) int { return b.Insns - a.Insns })
	if path := os.Getenv("IPMASQ_VERIFIER_STATS"); path != "" {
		b, err := json.MarshalIndent(report, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
