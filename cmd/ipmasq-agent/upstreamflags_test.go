package main

import (
	"bytes"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The Kubernetes ip-masq-agent whose flags ipmasq takes: the commit of
// kubernetes-sigs/ip-masq-agent the list in testdata/upstream-flags.txt
// was read from (v2.12.6 and 12 commits, the newest: klog v2.140.0, whose
// -alsologtostderrthreshold and -legacy_stderr_threshold_behavior an
// operator following upstream's current docs may pass).
const upstreamPin = "e3000864e0dd2a670340ae42e0eba1ada5be738a"

const upstreamFlagsFile = "testdata/upstream-flags.txt"

// upstreamFlag is one flag of the upstream binary.
type upstreamFlag struct {
	name, kind, def string
	// value is one the upstream binary accepts, given to ipmasq.
	value string
}

// upstreamGitDir is a clone of kubernetes-sigs/ip-masq-agent
// ($IPMASQ_UPSTREAM_GIT, or where the fetch tool leaves it).
func upstreamGitDir() string {
	if d := os.Getenv("IPMASQ_UPSTREAM_GIT"); d != "" {
		return d
	}
	return "/work/.mirror/kubernetes-sigs+ip-masq-agent/repo"
}

// readUpstreamFlags reads the flags of the upstream binary at upstreamPin
// from its source: the flag.* calls of cmd/ip-masq-agent/ip-masq-agent.go,
// and, since its main calls klog.InitFlags(nil), klog's flags at the
// version its go.mod requires (from the Go module cache). No other package
// it links registers a Go flag (component-base's logs and verflag use
// flag sets of their own or pflag, which its flag.Parse does not read).
func readUpstreamFlags(gitDir string) ([]upstreamFlag, error) {
	show := func(path string) ([]byte, error) {
		out, err := exec.Command("git", "--git-dir="+gitDir, "show", upstreamPin+":"+path).Output()
		if err != nil {
			return nil, fmt.Errorf("git show %s:%s in %s: %w", upstreamPin, path, gitDir, err)
		}
		return out, nil
	}
	mainSrc, err := show("cmd/ip-masq-agent/ip-masq-agent.go")
	if err != nil {
		return nil, err
	}
	gomod, err := show("go.mod")
	if err != nil {
		return nil, err
	}
	m := regexp.MustCompile(`(?m)^\s*k8s\.io/klog/v2 (v\S+)`).FindSubmatch(gomod)
	if m == nil {
		return nil, errors.New("upstream go.mod requires no k8s.io/klog/v2")
	}
	modCache, err := exec.Command("go", "env", "GOMODCACHE").Output()
	if err != nil {
		return nil, err
	}
	klogPath := filepath.Join(strings.TrimSpace(string(modCache)), "k8s.io", "klog", "v2@"+string(m[1]), "klog.go")
	klogSrc, err := os.ReadFile(klogPath)
	if err != nil {
		return nil, fmt.Errorf("klog %s source (go mod download k8s.io/klog/v2@%s): %w", m[1], m[1], err)
	}

	var out []upstreamFlag
	fset := token.NewFileSet()
	mainFile, err := parser.ParseFile(fset, "ip-masq-agent.go", mainSrc, 0)
	if err != nil {
		return nil, err
	}
	initsKlog := false
	ast.Inspect(mainFile, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		pkg, fn := selector(call.Fun)
		switch {
		case pkg == "klog" && fn == "InitFlags":
			initsKlog = true
		case pkg == "flag" && len(call.Args) == 3 && fn != "Var":
			name, def := stringLit(call.Args[0]), exprText(mainSrc, fset, call.Args[1])
			out = append(out, upstreamFlag{name: name, kind: strings.ToLower(fn), def: def,
				value: exampleValue(name, strings.ToLower(fn), def, exprText(mainSrc, fset, call.Args[2]))})
		}
		return true
	})
	if !initsKlog {
		return out, nil
	}
	klogFile, err := parser.ParseFile(fset, "klog.go", klogSrc, 0)
	if err != nil {
		return nil, err
	}
	ast.Inspect(klogFile, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		recv, fn := selector(call.Fun)
		if recv != "commandLine" || len(call.Args) < 2 {
			return true
		}
		f := upstreamFlag{name: stringLit(call.Args[1])}
		if fn == "Var" {
			// The kind is the value's: name it by the field it sets.
			_, field := selector(ast.Unparen(call.Args[0]).(*ast.UnaryExpr).X)
			f.kind, f.def = "var:"+field, "-"
		} else {
			f.kind, f.def = strings.ToLower(strings.TrimSuffix(fn, "Var")), exprText(klogSrc, fset, call.Args[2])
		}
		f.value = exampleValue(f.name, f.kind, f.def, "")
		out = append(out, f)
		return true
	})
	return out, nil
}

func selector(e ast.Expr) (string, string) {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok {
		return "", ""
	}
	if id, ok := sel.X.(*ast.Ident); ok {
		return id.Name, sel.Sel.Name
	}
	return "", sel.Sel.Name
}

func stringLit(e ast.Expr) string {
	if lit, ok := e.(*ast.BasicLit); ok {
		if s, err := strconv.Unquote(lit.Value); err == nil {
			return s
		}
	}
	return "?"
}

func exprText(src []byte, fset *token.FileSet, e ast.Expr) string {
	return string(src[fset.Position(e.Pos()).Offset:fset.Position(e.End()).Offset])
}

// exampleValue is a value the upstream binary accepts for a flag: the
// example of its usage text when it has one (--to-ports'
// "1024-29999,32768-65535"), else one of its kind that is not the default.
func exampleValue(name, kind, def, usage string) string {
	if m := regexp.MustCompile(`example: \\?"([^"\\]+)\\?"`).FindStringSubmatch(usage); m != nil {
		return m[1]
	}
	switch kind {
	case "bool":
		return strconv.FormatBool(def != "true")
	case "int", "uint64":
		return "7"
	case "var:verbosity":
		return "2"
	case "var:stderrThreshold", "var:alsologtostderrthreshold":
		return "WARNING"
	case "var:vmodule":
		return "main=4"
	case "var:traceLocation":
		return "main.go:10"
	}
	if name == "masq-chain" {
		return "IP-MASQ"
	}
	return "x"
}

func formatUpstreamFlags(flags []upstreamFlag) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Every flag of the Kubernetes ip-masq-agent binary at kubernetes-sigs/ip-masq-agent@%s,\n", upstreamPin)
	b.WriteString("# read from its source (its flag.* calls, and klog.InitFlags at the klog its go.mod requires).\n")
	b.WriteString("# Generated: go test ./cmd/ipmasq-agent -run TestUpstreamFlagsMatchSource -update-upstream-flags\n")
	b.WriteString("# name\tkind\tdefault\ta value upstream accepts\n")
	for _, f := range flags {
		fmt.Fprintf(&b, "%s\t%s\t%s\t%s\n", f.name, f.kind, f.def, f.value)
	}
	return b.String()
}

func loadUpstreamFlags(t *testing.T) []upstreamFlag {
	t.Helper()
	data, err := os.ReadFile(upstreamFlagsFile)
	if err != nil {
		t.Fatal(err)
	}
	var out []upstreamFlag
	for _, line := range strings.Split(string(data), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Split(line, "\t")
		if len(f) != 4 {
			t.Fatalf("%s: line %q: want 4 tab-separated fields", upstreamFlagsFile, line)
		}
		out = append(out, upstreamFlag{f[0], f[1], f[2], f[3]})
	}
	return out
}

// TestEveryUpstreamFlagStarts runs the real binary with every flag of the
// upstream binary, alone and all together, in the spellings upstream's Go
// flag package takes (--name=value, -name=value, -name value, and a
// boolean's bare -name), with a value upstream
// accepts: each must get past the flags to the agent's start-up, which here
// stops at the first check that follows them (a --bpf-root that is not a
// BPF filesystem: one line naming --bpf-root), never exit naming the flag.
func TestEveryUpstreamFlagStarts(t *testing.T) {
	flags := loadUpstreamFlags(t)
	bin := filepath.Join(t.TempDir(), "ipmasq-agent")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	private := t.TempDir()
	notBPF := filepath.Join(private, "not-bpffs")
	if err := os.Mkdir(notBPF, 0o700); err != nil {
		t.Fatal(err)
	}
	run := func(t *testing.T, args ...string) {
		t.Helper()
		cmd := exec.Command(bin, append(args, "--bpf-root="+notBPF)...)
		cmd.Env = append(os.Environ(),
			"IPMASQ_STATE_DIR="+filepath.Join(private, "state"),
			"IPMASQ_API_SOCKET="+filepath.Join(private, "run", "api.sock"),
			"IPMASQ_SHELL_SOCK_PATH="+filepath.Join(private, "run", "shell.sock"),
			"IPMASQ_IP_MASQ_AGENT_CONFIG_PATH="+filepath.Join(private, "config", "ip-masq-agent"),
			"K8S_NODE_NAME=", "KUBERNETES_SERVICE_HOST=")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		var exit *exec.ExitError
		lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
		last := lines[len(lines)-1]
		if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(last, "--bpf-root") {
			t.Fatalf("%v: exit %v; want it past the flags, stopped by --bpf-root; stderr:\n%s", args, err, stderr.String())
		}
	}
	var all []string
	for _, f := range flags {
		arg := f.name + "=" + f.value
		all = append(all, "--"+arg)
		t.Run(arg, func(t *testing.T) {
			run(t, "--"+arg)
			run(t, "-"+arg)
			// Go's flag package also takes a value as the next argument
			// (-v 2), and a boolean without one (-logtostderr).
			if f.kind == "bool" {
				run(t, "-"+f.name)
				run(t, "--"+f.name)
			} else {
				run(t, "-"+f.name, f.value)
				run(t, "--"+f.name, f.value)
			}
		})
	}
	t.Run("all together", func(t *testing.T) { run(t, all...) })
}
