package ipmasq_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// The architecture of the tree, checked on every `go test`: data flows one
// way, tables ← bpf ← reconcilers ← cells (writers) and readers ← agent ←
// cmd, and test tooling never reaches production code. docs/layout.md
// explains each folder.

const module = "github.com/ipmasq/ipmasq"

// layer is one level of the tree. A package may import packages of lower
// layers and leaves; see importAllowed for the rules inside a layer.
type layer struct {
	name string
	// paths are module-relative package paths; a trailing "/" matches every
	// package under that folder.
	paths []string
}

// layers, lowest first. Leaves (shared settings, the generic map library,
// the API's wire types and client, and every package under internal/: the
// socket helper, the Kubernetes API connection, the build stamp, the state
// lock, the cgroup memory limit) import no other package of the module and
// may be imported by all. internal/ is a leaf folder as a whole, so that a
// package placed there cannot reach up into the layers (the test kit did,
// when it lived there).
var layers = []layer{
	{"leaf", []string{"settings", "bpfmap", "ipamapi", "internal/"}},
	{"tables", []string{"tables"}},
	{"bpf", []string{"bpf"}},
	{"reconcilers", []string{"reconcilers/"}},
	{"cells", []string{"cells/", "readers/"}},
	// The composition root, and uninstall: the other package that needs
	// every owner of a kernel object or file together.
	{"agent", []string{"agent", "uninstall"}},
	// The namespace networks of the demo, beside it (the end-to-end tests
	// use them too): above the agent, so that no production package can
	// import them, below the commands.
	{"topology", []string{"cmd/ipmasq-demo/topology"}},
	{"cmd", []string{"cmd/"}},
	// Build tools (the image builder): programs of the module that are
	// not shipped and link nothing of the agent.
	{"tools", []string{"tools/"}},
}

// testKit is the folder of everything that exists for tests only: tooling
// (faults, private bpffs mounts, the real API server and node, tool
// builds) and the end-to-end suites. It stands above every layer (it may
// import them all) and no production package imports it; a new test
// package goes under testKit and is recognised without a list to keep.
const testKit = "testkit/"

// testTooling are packages that exist for tests only; no production package
// may import them.
var testTooling = []string{
	"testing",
	"testing/",
	"net/http/httptest",
	"github.com/cilium/hive/script/scripttest",
	module + "/" + testKit,
}

// testOnly are the module's packages that are test tooling or test suites:
// they are exempt from the rules, and the layering does not place them.
var testOnly = []string{"", "deploy", testKit}

// knownViolations are imports that break the rules, each with the change
// that will remove it; the test fails for a listed import that no longer
// exists, so the list only shrinks. Empty: issue #10 removed the last ones.
var knownViolations = map[string]string{}

type goPackage struct {
	ImportPath string
	Imports    []string
	Error      *struct{ Err string }
}

// listPackages runs `go list` on the module: the packages and the imports
// of their non-test files.
func listPackages(t *testing.T) []goPackage {
	t.Helper()
	goTool := filepath.Join(runtime.GOROOT(), "bin", "go")
	cmd := exec.Command(goTool, "list", "-e", "-json=ImportPath,Imports,Error", "./...")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list ./...: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list ./...: %v", err)
	}
	var pkgs []goPackage
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p goPackage
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("decode go list output: %v", err)
		}
		if p.Error != nil {
			t.Fatalf("go list %s: %s", p.ImportPath, p.Error.Err)
		}
		pkgs = append(pkgs, p)
	}
	if len(pkgs) < 10 {
		t.Fatalf("go list found only %d packages: not run from the module root?", len(pkgs))
	}
	return pkgs
}

// relative returns the module-relative path of an import path, and whether
// it is in the module.
func relative(path string) (string, bool) {
	if path == module {
		return "", true
	}
	rel, ok := strings.CutPrefix(path, module+"/")
	return rel, ok
}

func matches(rel string, patterns []string) bool {
	for _, p := range patterns {
		if rel == p || (strings.HasSuffix(p, "/") && strings.HasPrefix(rel, p)) {
			return true
		}
	}
	return false
}

// layerOf returns the index of rel's layer in layers, or -1.
func layerOf(rel string) int {
	for i, l := range layers {
		if matches(rel, l.paths) {
			return i
		}
	}
	return -1
}

// top is the first element of a module-relative path: "cells", "readers", ...
func top(rel string) string {
	first, _, _ := strings.Cut(rel, "/")
	return first
}

// datapathLoader is the one reconcilers/ package other reconcilers may
// import: it loads the datapath and provides the loaded programs and maps
// (datapath.Handle) and the datapath's flags (datapath.Config), which the
// reconciler of each kernel object (tcattach, masqrules, masqsources,
// nodeaddrs, natgc) writes into. It imports no reconciler itself (the
// layering refuses that like any other reconciler-to-reconciler import).
const datapathLoader = "reconcilers/datapath"

// importAllowed says why from may not import to (both module-relative), or
// "" when it may.
func importAllowed(from, to string) string {
	lf, lt := layerOf(from), layerOf(to)
	switch {
	case lt < 0:
		return fmt.Sprintf("%s is in no layer", to)
	case layers[lf].name == "leaf":
		return "a leaf imports no other package of the module"
	case layers[lt].name == "leaf":
		return ""
	case lt > lf:
		return fmt.Sprintf("%s (layer %s) is above %s (layer %s)", to, layers[lt].name, from, layers[lf].name)
	}
	// Only the composition root (agent) and the binaries put reconcilers
	// and cells together: writers and readers work on tables alone, so
	// nothing depends on a reconciler having started first.
	if (top(from) == "cells" || top(from) == "readers") && top(to) == "reconcilers" {
		return "cells and readers read tables, never a reconciler"
	}
	if lt < lf {
		return ""
	}
	// Same layer: each reconciler stands alone, and writers and readers do
	// not import each other.
	if top(from) != top(to) {
		return fmt.Sprintf("%s and %s are in the same layer %s", from, to, layers[lf].name)
	}
	if top(from) == "reconcilers" && to != datapathLoader {
		return "a reconciler does not import another reconciler"
	}
	if top(from) == "cells" && from != to && frontEnds[from] != to {
		return "a writer does not import another writer: share through a table (tables/) or a setting (settings/)"
	}
	return ""
}

// frontEnds are the cells that serve another cell's own methods to the
// outside, and so import it: the unix-socket API answers with the IPAM's
// allocations.
var frontEnds = map[string]string{"cells/api": "cells/ipam"}

func TestArchitecture(t *testing.T) {
	pkgs := listPackages(t)
	seen := map[string]bool{}
	var problems []string
	for _, p := range pkgs {
		from, ok := relative(p.ImportPath)
		if !ok || matches(from, testOnly) {
			continue
		}
		if layerOf(from) < 0 {
			problems = append(problems, fmt.Sprintf("%s is in no layer: add it to layers in architecture_test.go and to docs/layout.md", from))
			continue
		}
		for _, imp := range p.Imports {
			var why string
			if matches(imp, testTooling) {
				why = "production code imports test tooling"
			} else if to, ok := relative(imp); ok {
				why = importAllowed(from, to)
			}
			if why == "" {
				continue
			}
			edge := from + " -> " + strings.TrimPrefix(imp, module+"/")
			if _, known := knownViolations[edge]; known {
				seen[edge] = true
				continue
			}
			problems = append(problems, fmt.Sprintf("%s: %s", edge, why))
		}
	}
	for edge := range knownViolations {
		if !seen[edge] {
			problems = append(problems, fmt.Sprintf("%s is no longer imported: remove it from knownViolations", edge))
		}
	}
	slices.Sort(problems)
	for _, p := range problems {
		t.Error(p)
	}
}

// TestArchitectureRules checks the rules themselves on imports that must be
// refused, so that TestArchitecture cannot pass by accepting everything.
func TestArchitectureRules(t *testing.T) {
	refused := [][2]string{
		{"bpf", "reconcilers/datapath"},
		{"tables", "bpf"},
		{"reconcilers/iprules", "cells/ipam"},
		{"reconcilers/datapath", "reconcilers/nonmasqmaps"},
		{"reconcilers/datapath", "reconcilers/tcattach"},
		{"reconcilers/tcattach", "reconcilers/nodeaddrs"},
		{"reconcilers/natgc", "reconcilers/masqrules"},
		{"reconcilers/iprules", "reconcilers/nonmasqmaps"},
		{"cells/config", "agent"},
		{"readers/metrics", "reconcilers/datapath"},
		{"readers/status", "cells/ipam"},
		{"cells/ipam", "readers/status"},
		{"settings", "tables"},
		{"bpfmap", "bpf"},
		{"agent", "cmd/ipmasq-agent"},
		{"reconcilers/iprules", "cmd/ipmasq-demo/topology"},
		{"cells/devices", "nowhere"},
		{"cells/k8snode", "cells/podcidrs"},
		{"cells/podcidrs", "cells/ipam"},
		{"cells/ipam", "cells/api"},
		// internal/ holds leaves only: no test kit or demo network there
		// that reaches up (netnstest did, into the writers).
		{"internal/netnstest", "cells/devices"},
		{"internal/cgroupmem", "reconcilers/datapath"},
		{"internal/unixsock", "settings"},
		{"cmd/ipmasq-demo/topology", "cmd/ipmasq-demo"},
	}
	for _, e := range refused {
		if importAllowed(e[0], e[1]) == "" {
			t.Errorf("%s -> %s is accepted, want refused", e[0], e[1])
		}
	}
	accepted := [][2]string{
		{"bpf", "bpfmap"},
		{"bpf", "tables"},
		{"reconcilers/nonmasqmaps", "settings"},
		{"reconcilers/datapath", "bpf"},
		{"reconcilers/nodeaddrs", "reconcilers/datapath"},
		{"reconcilers/tcattach", "reconcilers/datapath"},
		{"cells/api", "cells/ipam"},
		{"readers/metrics", "bpf"},
		{"agent", "reconcilers/iprules"},
		{"cmd/ipmasq-demo", "cmd/ipmasq-demo/topology"},
		{"cmd/ipmasq-agent", "agent"},
		{"reconcilers/datapath", "internal/cgroupmem"},
		{"cells/k8snode", "internal/kubeclient"},
	}
	for _, e := range accepted {
		if why := importAllowed(e[0], e[1]); why != "" {
			t.Errorf("%s -> %s is refused (%s), want accepted", e[0], e[1], why)
		}
	}
	if !matches("testing/fstest", testTooling) || !matches(module+"/testkit/faults", testTooling) {
		t.Error("test tooling is not recognised")
	}
}

// TestCNIPluginLinksOnlyTheClient: the CNI plugin runs once per pod
// sandbox and only sends one request to the agent, so it links the API's
// wire types and client and nothing of the agent (no hive, no tables, no
// BPF).
func TestCNIPluginLinksOnlyTheClient(t *testing.T) {
	goTool := filepath.Join(runtime.GOROOT(), "bin", "go")
	out, err := exec.Command(goTool, "list", "-deps", "./cmd/ipmasq-cni").Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/ipmasq-cni: %v", err)
	}
	var linked []string
	for _, dep := range strings.Fields(string(out)) {
		rel, ours := relative(dep)
		if (ours && rel != "ipamapi" && rel != "cmd/ipmasq-cni") || strings.HasPrefix(dep, "github.com/cilium/") {
			linked = append(linked, dep)
		}
	}
	if len(linked) > 0 {
		t.Errorf("cmd/ipmasq-cni links %v; it may link only %s/ipamapi of the module and nothing of cilium", linked, module)
	}
}

// TestPackageNamesAreUnique: two packages with one name make every file
// that needs both alias one of them, and a reader cannot tell from a call
// (datapath.Cell) which package it is. Commands are all package main.
func TestPackageNamesAreUnique(t *testing.T) {
	goTool := filepath.Join(runtime.GOROOT(), "bin", "go")
	out, err := exec.Command(goTool, "list", "-f", "{{.Name}} {{.ImportPath}}", "./...").Output()
	if err != nil {
		t.Fatalf("go list ./...: %v", err)
	}
	byName := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		name, path, _ := strings.Cut(line, " ")
		if name != "main" {
			byName[name] = append(byName[name], path)
		}
	}
	for name, paths := range byName {
		if len(paths) > 1 {
			t.Errorf("package name %s is used by %v: rename all but one", name, paths)
		}
	}
}
