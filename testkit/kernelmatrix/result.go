// Package kernelmatrix proves the datapath on the kernels users' nodes run
// (Debian's 5.10, 6.1 and 6.12, testkit/vmtest): TestKernelMatrix
// boots each under qemu and runs, in the guest, the verifier check (every
// program of every object loaded, the verifier's instruction counts
// recorded), the demo in both attach modes, and the datapath e2e tests
// that matter most. Each kernel's results are a JSON file; the committed
// ones (testdata/<kernel>.json, refreshed with -update) are the source of
// docs/deploy.md's table of kernels, which TestDeployDocKernelTable checks.
package kernelmatrix

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Result is one kernel's run of the matrix.
type Result struct {
	// Kernel is the matrix's name for it: "5.10", "6.1", "6.12".
	Kernel string `json:"kernel"`
	// Package is the Debian package and version booted.
	Package string `json:"package"`
	// Release is uname -r in the guest.
	Release string `json:"release"`
	// AttachMode is what the kernel offers the datapath: "tcx" when a
	// tcx link attaches in the guest, "clsact" otherwise.
	AttachMode string `json:"attach_mode"`
	// TCXError is why a tcx link did not attach.
	TCXError string `json:"tcx_error,omitempty"`
	// ConntrackKfuncs says whether the kernel has the conntrack kfuncs
	// (bpf_skb_ct_lookup, 5.18) the flow handover needs.
	ConntrackKfuncs bool `json:"conntrack_kfuncs"`
	// Variant is the datapath variant the agent's auto choice loads on
	// the kernel: full where the verifier check loaded it, else compat.
	Variant string `json:"variant,omitempty"`
	// VerifierCheck is the bpf test run for the verifier check:
	// TestVerifierComplexity, or the load tests where it does not exist.
	VerifierCheck string `json:"verifier_check"`
	// VerifierPassed says whether every program loaded.
	VerifierPassed bool `json:"verifier_passed"`
	// ProgramsLoaded counts the programs the verifier accepted (from the
	// check's statistics; -1 when the check reports none).
	ProgramsLoaded int `json:"programs_loaded"`
	// MaxVerifierInsns is the largest instruction count the verifier
	// processed for one program, and MaxVerifierProgram that program.
	MaxVerifierInsns   int    `json:"max_verifier_insns"`
	MaxVerifierProgram string `json:"max_verifier_program,omitempty"`
	// Demo is the demo's outcome per --tc-attach-mode ("auto", "clsact"):
	// "pass" or "fail".
	Demo map[string]string `json:"demo"`
	// E2E is each datapath e2e test's outcome: "pass", "fail" or "not
	// run" (the binary stopped before it).
	E2E map[string]string `json:"e2e"`
	// Failures names what failed, for the report and the docs' table.
	Failures []string `json:"failures,omitempty"`
	// Rerun, when not empty, is where the guest's kernel panicked in a
	// first run of the kernel (the results are the second run's).
	Rerun string `json:"rerun,omitempty"`
	// BootSeconds is the guest's uptime when the matrix's script started;
	// Seconds the kernel's whole run (boot, checks, power-off).
	BootSeconds float64 `json:"boot_seconds"`
	Seconds     float64 `json:"seconds"`
}

// Passed says whether everything ran on this kernel passed.
func (r *Result) Passed() bool { return len(r.Failures) == 0 }

// E2EPassed counts the passed e2e tests.
func (r *Result) E2EPassed() int {
	n := 0
	for _, v := range r.E2E {
		if v == "pass" {
			n++
		}
	}
	return n
}

// testdataDir is where the committed results are.
const testdataDir = "testdata"

// readCommitted reads testdata/<kernel>.json for every kernel that has one,
// oldest kernel first.
func readCommitted(dir string) ([]*Result, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	var out []*Result
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		var r Result
		if err := json.Unmarshal(b, &r); err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		if want := r.Kernel + ".json"; filepath.Base(f) != want {
			return nil, fmt.Errorf("%s: holds kernel %q, want it in %s", f, r.Kernel, want)
		}
		out = append(out, &r)
	}
	sort.Slice(out, func(i, j int) bool { return versionLess(out[i].Kernel, out[j].Kernel) })
	return out, nil
}

// versionLess orders "5.10" < "6.1" < "6.12".
func versionLess(a, b string) bool {
	var a1, a2, b1, b2 int
	fmt.Sscanf(a, "%d.%d", &a1, &a2)
	fmt.Sscanf(b, "%d.%d", &b1, &b2)
	if a1 != b1 {
		return a1 < b1
	}
	return a2 < b2
}

// Table is docs/deploy.md's table of tested kernels, from results.
func Table(results []*Result) string {
	var b strings.Builder
	b.WriteString("| kernel (Debian package) | attach mode | variant | programs loaded (largest verifier count) | demo (auto, clsact) | e2e | lacks |\n")
	b.WriteString("|---|---|---|---|---|---|---|\n")
	for _, r := range results {
		variant := r.Variant
		if variant == "" {
			variant = "—"
		}
		programs := "rejected"
		if r.VerifierPassed {
			if r.ProgramsLoaded >= 0 {
				programs = fmt.Sprintf("all %d (%d)", r.ProgramsLoaded, r.MaxVerifierInsns)
			} else {
				programs = "all"
			}
		}
		var lack []string
		if !r.ConntrackKfuncs {
			lack = append(lack, "conntrack kfuncs (5.18): no flow handover in a migration (docs/migrate.md)")
		}
		if !r.Passed() {
			lack = append(lack, "fails: "+strings.Join(r.Failures, "; "))
		}
		if r.Rerun != "" {
			lack = append(lack, "run twice: the guest's kernel panicked in the first run under TCG ("+r.Rerun+")")
		}
		lacks := "—"
		if len(lack) > 0 {
			lacks = strings.Join(lack, "; ")
		}
		cells := []string{
			r.Release + " (" + r.Package + ")", r.AttachMode, variant, programs,
			r.Demo["auto"] + ", " + r.Demo["clsact"],
			fmt.Sprintf("%d/%d", r.E2EPassed(), len(r.E2E)), lacks,
		}
		for i, c := range cells {
			// A verifier message or a test pattern may hold a '|'.
			cells[i] = strings.ReplaceAll(c, "|", `\|`)
		}
		fmt.Fprintf(&b, "| %s |\n", strings.Join(cells, " | "))
	}
	return b.String()
}
