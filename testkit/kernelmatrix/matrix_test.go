package kernelmatrix

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/testkit/privtest"
	"github.com/ipmasq/ipmasq/testkit/vmtest"
)

var update = flag.Bool("update", false, "write the kernels' results to testdata/ and docs/deploy.md's table from them")

// e2eTests are the datapath e2e tests the matrix runs in each guest (each
// datapath scenario runs under Linux MASQUERADE first): masquerade v4/v6,
// restart keeps streams, clsact attach (and the switch to tcx), ICMP
// errors, the early drop at a full table; the conntrack handover where the
// kernel has what it needs (handoverTests); and the refusal of what the
// kernel cannot run (no kernel BTF; on 5.10 the full variant forced), with
// an earlier agent's datapath kept masquerading.
var e2eTests = []string{
	"TestMasqueradeIPv4",
	"TestMasqueradeIPv6",
	"TestRestartKeepsStreams",
	"TestClsactAttach",
	"TestPodPortUnreachable",
	"TestFullTableSparesEstablished",
	"TestKernelRefused",
	"TestRefusedUpgradeKeepsMasquerading",
}

// tcxTests run only where the guest attaches a tcx link.
var tcxTests = []string{"TestForeignTCProgramsFirst"}

// handoverTests run only where the kernel has the conntrack kfuncs
// (5.18): elsewhere the agent says the handover is not possible and moves
// no flow (docs/migrate.md), and the docs' table says what the kernel
// lacks.
var handoverTests = []string{"TestMigrationKeepsFlows"}

// perKernel bounds one kernel's guest run (the script's steps are bounded
// to less: 4 + 5 + 5 + 20 minutes). Under TCG a load of the programs takes
// the verifier tens of seconds (the compat build on 5.10 the longest), and
// each e2e test starts the agent at least once.
const perKernel = 36 * time.Minute

// TestKernelMatrix boots each kernel of vmtest.Kernels under qemu (TCG)
// and runs the verifier check, the demo in both attach modes and the e2e
// tests in the guest. A kernel where anything fails fails the test; each
// kernel's results are written as JSON to $IPMASQ_KERNEL_RESULTS (or a
// directory in the temporary directory, named in the log), and with
// -update to testdata/ as well. Without -update, a kernel whose attach
// mode, variant or outcome differs from testdata/ fails too: the docs'
// table (from testdata/) would no longer be true.
func TestKernelMatrix(t *testing.T) {
	privtest.Require(t)
	if _, err := exec.LookPath(vmtest.QEMU); err != nil {
		t.Fatalf("%s is not installed (Debian package qemu-system-x86; tools/deps.sh installs it): %v", vmtest.QEMU, err)
	}
	begin := time.Now()
	repo := moduleRoot(t)
	bins := buildBinaries(t, repo)
	out := os.Getenv("IPMASQ_KERNEL_RESULTS")
	if out == "" {
		out = filepath.Join(os.TempDir(), "ipmasq-kernel-matrix")
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("results: %s", out)
	if host, err := hostProbe(bins); err == nil {
		writeJSON(t, filepath.Join(out, "host.json"), host)
		t.Logf("host kernel %s (the whole suite runs on it): tcx %v", host.Release, host.TCX)
	} else {
		t.Errorf("probe the host's kernel: %v", err)
	}
	committed, err := readCommitted(testdataDir)
	if err != nil {
		t.Fatal(err)
	}
	byKernel := map[string]*Result{}
	for _, r := range committed {
		byKernel[r.Kernel] = r
	}
	// One kernel at a time: TCG's two vCPU threads use both of the CI
	// machine's cores.
	for _, spec := range vmtest.Kernels {
		t.Run(spec.Name, func(t *testing.T) {
			r := runKernel(t, spec, repo, bins)
			writeJSON(t, filepath.Join(out, spec.Name+".json"), r)
			t.Logf("kernel %s (%s): attach %s, verifier %v (%d programs, max %d insns in %s), demo %v, e2e %d/%d, boot %.1fs, %.0fs",
				r.Kernel, r.Release, r.AttachMode, r.VerifierPassed, r.ProgramsLoaded, r.MaxVerifierInsns, r.MaxVerifierProgram,
				r.Demo, r.E2EPassed(), len(r.E2E), r.BootSeconds, r.Seconds)
			if *update {
				writeJSON(t, filepath.Join(testdataDir, spec.Name+".json"), r)
			} else if c := byKernel[spec.Name]; c == nil {
				t.Errorf("no testdata/%s.json: run go test -run TestKernelMatrix -update ./testkit/kernelmatrix/ and commit it", spec.Name)
			} else if diff := documentedDiff(c, r); diff != "" {
				t.Errorf("kernel %s no longer matches testdata/%s.json (docs/deploy.md's table): %s; rerun with -update and commit", spec.Name, spec.Name, diff)
			}
			for _, f := range r.Failures {
				t.Errorf("kernel %s: %s", spec.Name, f)
			}
		})
	}
	if *update {
		results, err := readCommitted(testdataDir)
		if err != nil {
			t.Fatal(err)
		}
		if err := rewriteDeployTable(filepath.Join(repo, deployDoc), Table(results)); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("matrix: %v", time.Since(begin).Round(time.Second))
}

// documentedDiff names what docs/deploy.md's table shows that differs
// between the committed result c and this run's r.
func documentedDiff(c, r *Result) string {
	var d []string
	if c.AttachMode != r.AttachMode {
		d = append(d, fmt.Sprintf("attach mode %s, was %s", r.AttachMode, c.AttachMode))
	}
	if c.Variant != r.Variant {
		d = append(d, fmt.Sprintf("variant %q, was %q", r.Variant, c.Variant))
	}
	if c.ConntrackKfuncs != r.ConntrackKfuncs {
		d = append(d, fmt.Sprintf("conntrack kfuncs %v, was %v", r.ConntrackKfuncs, c.ConntrackKfuncs))
	}
	if c.VerifierPassed != r.VerifierPassed || c.ProgramsLoaded != r.ProgramsLoaded {
		d = append(d, fmt.Sprintf("programs loaded %v/%d, was %v/%d", r.VerifierPassed, r.ProgramsLoaded, c.VerifierPassed, c.ProgramsLoaded))
	}
	if c.Passed() != r.Passed() {
		d = append(d, fmt.Sprintf("passed %v, was %v", r.Passed(), c.Passed()))
	}
	return strings.Join(d, "; ")
}

// binaries are the host-built programs the guests run.
type binaries struct {
	dir                                  string
	bpfTest, e2eTest, agent, demo, probe string
	// verifierTest is the bpf test the verifier check runs.
	verifierTest string
}

func moduleRoot(t *testing.T) string {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// buildBinaries builds, on the host, the test binaries and programs the
// guests run: building under TCG would take minutes per kernel.
func buildBinaries(t *testing.T, repo string) binaries {
	t.Helper()
	dir, err := os.MkdirTemp("", "ipmasq-kernelmatrix-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	b := binaries{
		dir:     dir,
		bpfTest: filepath.Join(dir, "bpf.test"),
		e2eTest: filepath.Join(dir, "e2e.test"),
		agent:   filepath.Join(dir, "ipmasq-agent"),
		demo:    filepath.Join(dir, "ipmasq-demo"),
		probe:   filepath.Join(dir, "probe"),
	}
	for _, args := range [][]string{
		{"test", "-c", "-o", b.bpfTest, "./bpf/"},
		{"test", "-c", "-o", b.e2eTest, "./testkit/e2e/"},
		{"build", "-o", dir + "/", "./cmd/ipmasq-agent", "./cmd/ipmasq-demo", "./testkit/kernelmatrix/probe"},
	} {
		cmd := exec.Command("go", args...)
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	list, err := exec.Command(b.bpfTest, "-test.list", "^TestVerifierComplexity$").Output()
	if err != nil {
		t.Fatalf("%s -test.list: %v", b.bpfTest, err)
	}
	b.verifierTest = "^TestVerifierComplexity$"
	if !bytes.Contains(list, []byte("TestVerifierComplexity")) {
		// Until package bpf has its verifier-complexity test, the load
		// tests load every program of the object.
		b.verifierTest = "TestLoad|TestPin"
	}
	return b
}

type probeReport struct {
	Release         string `json:"release"`
	TCX             bool   `json:"tcx"`
	TCXError        string `json:"tcx_error"`
	ConntrackKfuncs bool   `json:"conntrack_kfuncs"`
}

func hostProbe(b binaries) (*probeReport, error) {
	out, err := exec.Command(b.probe).Output()
	if err != nil {
		return nil, err
	}
	var p probeReport
	return &p, json.Unmarshal(out, &p)
}

// script is the guest's command: each step's output and exit status go to
// the results directory; one boot runs them all.
const script = `
R=$1; D=$2; REPO=$3; VERIFIER=$4; E2E=$5; TCXE2E=$6; HANDOVERE2E=$7
step() {
	name=$1; limit=$2; shift 2
	start=$(date +%s)
	timeout -k 10 "$limit" "$@" >"$R/$name.log" 2>&1
	rc=$?
	echo $rc >"$R/$name.rc"
	echo "step $name: exit $rc in $(( $(date +%s) - start ))s"
}
# nf_conntrack's kfuncs are in its module: loaded as on a node with
# kube-proxy (the e2e tests' iptables rules load it too).
modprobe nf_conntrack 2>/dev/null
"$D/probe" >"$R/probe.json" 2>"$R/probe.err"
cd "$REPO/bpf" && step verifier 240 env IPMASQ_VERIFIER_STATS="$R/verifier.json" "$D/bpf.test" -test.run "$VERIFIER" -test.v -test.timeout 230s
cd / && step demo-auto 300 "$D/ipmasq-demo" --agent "$D/ipmasq-agent" --tc-attach-mode=auto --timeout 240s
if grep -q '"tcx":true' "$R/probe.json"; then
	cd / && step demo-clsact 300 "$D/ipmasq-demo" --agent "$D/ipmasq-agent" --tc-attach-mode=clsact --timeout 240s
	E2E="$E2E|$TCXE2E"
fi
if grep -q '"conntrack_kfuncs":true' "$R/probe.json"; then
	E2E="$E2E|$HANDOVERE2E"
fi
cd "$REPO/testkit/e2e" && step e2e 1200 env IPMASQ_E2E_AGENT="$D/ipmasq-agent" IPMASQ_E2E_AGENT_WAIT=240s IPMASQ_E2E_ANSWER_WAIT=10s "$D/e2e.test" -test.run "^($E2E)\$" -test.v -test.timeout 1190s
`

// runKernel runs the matrix on one kernel and returns its result; an error
// of the harness itself (no kernel, no guest status) is fatal.
func runKernel(t *testing.T, spec vmtest.Spec, repo string, b binaries) *Result {
	begin := time.Now()
	k, err := vmtest.Fetch(spec.Name)
	if err != nil {
		t.Fatal(err)
	}
	var res string
	boot := func() (*vmtest.Result, error) {
		var err error
		if res, err = os.MkdirTemp("", "ipmasq-kernelmatrix-"+spec.Name+"-"); err != nil {
			t.Fatal(err)
		}
		dir := res
		t.Cleanup(func() { os.RemoveAll(dir) })
		ctx, cancel := context.WithTimeout(context.Background(), perKernel)
		defer cancel()
		logw := &lineLogger{t: t}
		defer logw.flush()
		return vmtest.Run(ctx, vmtest.Options{
			Kernel: k,
			Argv: []string{"sh", "-c", script, "matrix", res, b.dir, repo, b.verifierTest,
				strings.Join(e2eTests, "|"), strings.Join(tcxTests, "|"), strings.Join(handoverTests, "|")},
			Output:     logw,
			ResultsDir: res,
		})
	}
	vr, err := boot()
	var panicked string
	if p, ok := guestPanic(err); ok {
		// Under TCG a guest's kernel has panicked in its packet path at
		// an instruction boundary that live code patching moves (a
		// static key flipped by an attach on the other vCPU): the run
		// is repeated once, and the panic recorded in the results.
		panicked = p
		t.Logf("kernel %s: the guest's kernel panicked (%s); booting it once more:\n%v", spec.Name, p, err)
		vr, err = boot()
	}
	if err != nil {
		t.Fatalf("kernel %s: %v", spec.Name, err)
	}
	r := &Result{
		Kernel: spec.Name, Package: k.Package, Release: k.Release,
		ProgramsLoaded: -1,
		Demo:           map[string]string{},
		E2E:            map[string]string{},
		BootSeconds:    round1(vr.BootSeconds),
		Rerun:          panicked,
	}
	var p probeReport
	if b, err := os.ReadFile(filepath.Join(res, "probe.json")); err != nil || json.Unmarshal(b, &p) != nil {
		errText, _ := os.ReadFile(filepath.Join(res, "probe.err"))
		r.Failures = append(r.Failures, fmt.Sprintf("the attach probe failed: %s", errText))
	}
	if p.Release != "" {
		r.Release = p.Release
	}
	r.AttachMode, r.TCXError = "clsact", p.TCXError
	if p.TCX {
		r.AttachMode = "tcx"
	}
	r.ConntrackKfuncs = p.ConntrackKfuncs

	r.VerifierCheck = strings.Trim(b.verifierTest, "^$")
	r.VerifierPassed = stepRC(res, "verifier") == 0
	if !r.VerifierPassed {
		r.Failures = append(r.Failures, "programs rejected ("+r.VerifierCheck+": "+firstVerifierError(filepath.Join(res, "verifier.log"))+")")
	}
	if err := readVerifierStats(filepath.Join(res, "verifier.json"), r); err != nil {
		t.Logf("kernel %s: verifier statistics: %v", spec.Name, err)
	}
	modes := []string{"auto", "clsact"}
	if !p.TCX {
		// auto is clsact there: the one run says for both.
		modes = modes[:1]
	}
	for _, mode := range modes {
		r.Demo[mode] = "pass"
		if stepRC(res, "demo-"+mode) != 0 {
			r.Demo[mode] = "fail"
			r.Failures = append(r.Failures, "demo --tc-attach-mode="+mode+" fails")
			t.Logf("kernel %s: demo --tc-attach-mode=%s:\n%s", spec.Name, mode, tailOf(filepath.Join(res, "demo-"+mode+".log"), 3000))
		}
	}
	if !p.TCX {
		r.Demo["clsact"] = r.Demo["auto"]
	}
	want := append([]string(nil), e2eTests...)
	if r.AttachMode == "tcx" {
		want = append(want, tcxTests...)
	}
	if r.ConntrackKfuncs {
		want = append(want, handoverTests...)
	}
	outcomes := e2eOutcomes(filepath.Join(res, "e2e.log"))
	var failed []string
	for _, name := range want {
		o, ok := outcomes[name]
		if !ok {
			o = "not run"
		}
		r.E2E[name] = o
		if o != "pass" {
			failed = append(failed, name)
		}
	}
	if len(failed) > 0 {
		sort.Strings(failed)
		r.Failures = append(r.Failures, "e2e "+strings.Join(failed, ", "))
		t.Logf("kernel %s: e2e log's end:\n%s", spec.Name, tailOf(filepath.Join(res, "e2e.log"), 4000))
	}
	r.Seconds = round1(time.Since(begin).Seconds())
	return r
}

// guestPanic says whether err is a guest whose kernel panicked, and the
// console's line that says where.
func guestPanic(err error) (string, bool) {
	if err == nil || !strings.Contains(err.Error(), "Kernel panic") {
		return "", false
	}
	where := "Kernel panic"
	for l := range strings.SplitSeq(err.Error(), "\n") {
		if i := strings.Index(l, "RIP: 0010:"); i >= 0 {
			where = strings.TrimSpace(l[i:])
		}
	}
	return where, true
}

// stepRC is a script step's exit status (-1 when it did not run).
func stepRC(res, name string) int {
	b, err := os.ReadFile(filepath.Join(res, name+".rc"))
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1
	}
	return n
}

var outcomeLine = regexp.MustCompile(`^--- (PASS|FAIL|SKIP): (Test\w+) `)

// e2eOutcomes reads the top-level tests' outcomes from go test -v output.
func e2eOutcomes(path string) map[string]string {
	out := map[string]string{}
	f, err := os.Open(path)
	if err != nil {
		return out
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		if m := outcomeLine.FindStringSubmatch(s.Text()); m != nil {
			out[m[2]] = strings.ToLower(m[1])
		}
	}
	return out
}

// firstVerifierError is the first line of the check's output that says why
// a load failed.
func firstVerifierError(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "no output"
	}
	for _, l := range strings.Split(string(b), "\n") {
		l = strings.TrimSpace(l)
		if strings.Contains(l, "load program") || strings.Contains(l, "verifier") || strings.Contains(l, "invalid argument") || strings.Contains(l, "permission denied") {
			if len(l) > 240 {
				l = l[:240] + "..."
			}
			return l
		}
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}

// readVerifierStats reads IPMASQ_VERIFIER_STATS's file (package bpf's
// TestVerifierComplexity): {"variants": [...], "programs": [{"variant",
// "program", "insns"}, ...]}, every variant the kernel can take loaded. The
// result's variant is the one the agent's auto choice loads there (full
// where the kernel takes it, as the test's own probe decided, else
// compat), and the programs and largest count are that variant's.
func readVerifierStats(path string, r *Result) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var report struct {
		Variants []string `json:"variants"`
		Programs []struct {
			Variant string `json:"variant"`
			Program string `json:"program"`
			Insns   int    `json:"insns"`
		} `json:"programs"`
	}
	if err := json.Unmarshal(b, &report); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	switch {
	case slices.Contains(report.Variants, "full"):
		r.Variant = "full"
	case slices.Contains(report.Variants, "compat"):
		r.Variant = "compat"
	default:
		return fmt.Errorf("%s: no variant loaded (%v)", path, report.Variants)
	}
	loaded := 0
	for _, p := range report.Programs {
		if p.Variant != r.Variant {
			continue
		}
		loaded++
		if p.Insns > r.MaxVerifierInsns {
			r.MaxVerifierInsns, r.MaxVerifierProgram = p.Insns, p.Program
		}
	}
	r.ProgramsLoaded = loaded
	return nil
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
}

func tailOf(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func round1(f float64) float64 { return float64(int(f*10+0.5)) / 10 }

// lineLogger logs the guest's output a line at a time.
type lineLogger struct {
	t   *testing.T
	buf bytes.Buffer
}

func (l *lineLogger) Write(p []byte) (int, error) {
	l.buf.Write(p)
	for {
		line, err := l.buf.ReadString('\n')
		if err == io.EOF {
			l.buf.WriteString(line)
			return len(p), nil
		}
		l.t.Log(strings.TrimRight(line, "\n"))
	}
}

func (l *lineLogger) flush() {
	if l.buf.Len() > 0 {
		l.t.Log(l.buf.String())
		l.buf.Reset()
	}
}
