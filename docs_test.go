package ipmasq_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/bpf"
)

// Docs that cannot drift: each list an operator reads in docs/ (tables and
// their columns, pinned maps, drop reasons, the packages of the tree) is
// checked here against its one source in code, so that adding a table, a
// map or a reason without its line fails the tests with what is missing.
// The flags are checked in cmd/ipmasq-agent (TestDocsListEveryFlag).

// markdownTable returns the rows of the first table after heading (a
// line "## heading" or "### heading") in file, as cells with their
// surrounding spaces trimmed; the header and separator rows are left out.
func markdownTable(t *testing.T, file, heading string) [][]string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var rows [][]string
	seen, in := false, false
	for _, line := range strings.Split(string(data), "\n") {
		if h, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " "); ok && strings.HasPrefix(line, "#") {
			if seen && !in {
				continue
			}
			if in {
				break
			}
			seen = h == heading
			continue
		}
		if !seen {
			continue
		}
		if !strings.HasPrefix(line, "|") {
			if in {
				break
			}
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		if !in {
			in = true // the header row
			continue
		}
		if strings.HasPrefix(cells[0], "---") {
			continue
		}
		rows = append(rows, cells)
	}
	if len(rows) == 0 {
		t.Fatalf("%s: no table under %q", file, heading)
	}
	return rows
}

var codeSpan = regexp.MustCompile("`([^`]+)`")

// codeSpans returns the `code` spans of a table cell.
func codeSpans(cell string) []string {
	var out []string
	for _, m := range codeSpan.FindAllStringSubmatch(cell, -1) {
		out = append(out, m[1])
	}
	return out
}

// TestDocsListTheAgentsTables: docs/state.md lists every table of the
// agent's hive with exactly the columns `db/show` prints.
func TestDocsListTheAgentsTables(t *testing.T) {
	var db *statedb.DB
	h := agent.New(cell.Invoke(func(d *statedb.DB) { db = d }))
	// A config path of the test's own: the config cell reads it while the
	// tables are built.
	if err := h.Viper().MergeConfigMap(map[string]any{"ip-masq-agent-config-path": filepath.Join(t.TempDir(), "absent")}); err != nil {
		t.Fatal(err)
	}
	if err := h.Populate(hivetest.Logger(t)); err != nil {
		t.Fatal(err)
	}
	code := map[string]string{}
	for _, m := range db.GetTables(db.ReadTxn()) {
		code[m.Name()] = strings.Join(statedb.AnyTable{Meta: m}.TableHeader(), ", ")
	}
	docs := map[string]string{}
	for _, row := range markdownTable(t, "docs/state.md", "Tables") {
		names := codeSpans(row[0])
		if len(names) != 1 || len(row) < 3 {
			t.Errorf("docs/state.md, Tables: row %q: want | `table` | columns | holds |", row)
			continue
		}
		docs[names[0]] = row[1]
	}
	for name, cols := range code {
		switch doc, ok := docs[name]; {
		case !ok:
			t.Errorf("docs/state.md, Tables: no row for table %s (columns %s)", name, cols)
		case doc != cols:
			t.Errorf("docs/state.md, Tables: %s has columns %q, the docs say %q", name, cols, doc)
		}
	}
	for name := range docs {
		if _, ok := code[name]; !ok {
			t.Errorf("docs/state.md, Tables: table %s is not in the agent", name)
		}
	}
}

// TestDocsListEveryPinnedMap: docs/state.md names every map of the
// datapath objects, both builds (all of them are pinned), and those the
// loader pins beside them, and no other.
func TestDocsListEveryPinnedMap(t *testing.T) {
	var code []string
	for _, mt := range []reflect.Type{reflect.TypeOf(bpf.Maps{}), reflect.TypeOf(bpf.CompatMaps{})} {
		for i := range mt.NumField() {
			if name := mt.Field(i).Tag.Get("ebpf"); name != "" && !slices.Contains(code, name) {
				code = append(code, name)
			}
		}
	}
	code = append(code, bpf.LoaderMaps...)
	var docs []string
	for _, row := range markdownTable(t, "docs/state.md", "Pinned maps") {
		docs = append(docs, codeSpans(row[0])...)
	}
	slices.Sort(code)
	slices.Sort(docs)
	for _, name := range code {
		if !slices.Contains(docs, name) {
			t.Errorf("docs/state.md, Pinned maps: no row names map %s", name)
		}
	}
	for _, name := range docs {
		if !slices.Contains(code, name) {
			t.Errorf("docs/state.md, Pinned maps: map %s is not in the datapath object", name)
		}
	}
}

// TestDocsListEveryDropReason: docs/observability.md's table of drop
// reasons has one row per reason of the datapath, in its order.
func TestDocsListEveryDropReason(t *testing.T) {
	var code, docs []string
	for r := bpf.DropReason(0); r < bpf.NumDropReasons; r++ {
		code = append(code, r.String())
	}
	for _, row := range markdownTable(t, "docs/observability.md", "Drop reasons") {
		docs = append(docs, codeSpans(row[0])...)
	}
	slices.Sort(code)
	slices.Sort(docs)
	if !slices.Equal(code, docs) {
		t.Errorf("docs/observability.md, Drop reasons: the table has\n\t%s\nthe datapath's reasons are\n\t%s", docs, code)
	}
}

var markdownLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// TestDocsLinksStayInTheRepository: every relative link of README.md and
// docs/*.md leads to a file of the repository (a newcomer's clone has no
// ../shared), and its #anchor, if any, to a heading of that file.
func TestDocsLinksStayInTheRepository(t *testing.T) {
	files, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	root, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range append(files, "README.md") {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range markdownLink.FindAllStringSubmatch(string(data), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			abs := filepath.Join(filepath.Dir(filepath.Join(root, f)), path)
			if path == "" {
				abs = filepath.Join(root, f)
			}
			if rel, err := filepath.Rel(root, abs); err != nil || strings.HasPrefix(rel, "..") {
				t.Errorf("%s: link %s leads outside the repository", f, target)
				continue
			}
			if _, err := os.Stat(abs); err != nil {
				t.Errorf("%s: link %s: %v", f, target, err)
				continue
			}
			if anchor != "" && strings.HasSuffix(abs, ".md") && !slices.Contains(headingAnchors(t, abs), anchor) {
				t.Errorf("%s: link %s: no heading #%s in %s", f, target, anchor, path)
			}
		}
	}
}

// headingAnchors are the anchors GitHub makes of a markdown file's
// headings: lower case, spaces as dashes, punctuation but dashes and
// underscores dropped.
func headingAnchors(t *testing.T, file string) []string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	inCode := false
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
		}
		if inCode || !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))
		var b strings.Builder
		for _, r := range h {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
				b.WriteRune(r)
			}
		}
		out = append(out, b.String())
	}
	return out
}

// TestREADMEIsAFrontDoor: the README stays short enough to read in five
// minutes; reference material goes to docs/.
func TestREADMEIsAFrontDoor(t *testing.T) {
	data, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(data), "\n"); n > 200 {
		t.Errorf("README.md has %d lines; a front door has at most 200 (move reference material to docs/)", n)
	}
}

// TestLayoutListsEveryPackage: docs/layout.md's tree has a row for every
// package of the module (its folder, or a folder above it, named in the
// first column), and names no folder that is gone.
func TestLayoutListsEveryPackage(t *testing.T) {
	var listed []string
	for _, row := range markdownTable(t, "docs/layout.md", "The tree") {
		for _, p := range codeSpans(row[0]) {
			listed = append(listed, strings.TrimSuffix(p, "/"))
		}
	}
	covered := func(dir string) bool {
		for d := dir; d != "." && d != ""; d = filepath.Dir(d) {
			if slices.Contains(listed, d) {
				return true
			}
		}
		return false
	}
	for _, p := range listPackages(t) {
		rel, ok := relative(p.ImportPath)
		if !ok || rel == "" {
			continue
		}
		if !covered(rel) {
			t.Errorf("docs/layout.md, The tree: no row for %s/", rel)
		}
	}
	for _, p := range listed {
		if strings.ContainsAny(p, "*{ ") {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			t.Errorf("docs/layout.md, The tree: %s is listed but not in the tree: %v", p, err)
		}
	}
}

// TestDocsDescribeTheCCode: docs/datapath.md's "The C code" names every
// program of the object, its table every header of bpf/lib/ that is not a
// template, and its paragraph after the table every template.
func TestDocsDescribeTheCCode(t *testing.T) {
	data, err := os.ReadFile("docs/datapath.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(data), "\n## The C code\n")
	if !ok {
		t.Fatal("docs/datapath.md: no section \"The C code\"")
	}
	if next := strings.Index(section, "\n## "); next >= 0 {
		section = section[:next]
	}
	spans := codeSpans(section)
	pt := reflect.TypeOf(bpf.Programs{})
	for i := range pt.NumField() {
		if name := pt.Field(i).Tag.Get("ebpf"); name != "" && !slices.Contains(spans, name) {
			t.Errorf("docs/datapath.md, The C code: program %s of bpf/masq.c is not named", name)
		}
	}
	headers, err := filepath.Glob("bpf/lib/*.h")
	if err != nil || len(headers) == 0 {
		t.Fatalf("bpf/lib/*.h: %v", err)
	}
	var tableNames []string
	for _, row := range markdownTable(t, "docs/datapath.md", "The C code") {
		tableNames = append(tableNames, codeSpans(row[0])...)
	}
	for _, h := range headers {
		name := filepath.Base(h)
		in := slices.Contains(tableNames, name)
		if strings.HasSuffix(name, "_fam.h") {
			in = slices.Contains(spans, name)
		}
		if !in {
			t.Errorf("docs/datapath.md, The C code: %s is not described", name)
		}
	}
	for _, name := range spans {
		if strings.HasSuffix(name, ".h") && !strings.Contains(name, "/") {
			if _, err := os.Stat(filepath.Join("bpf/lib", name)); err != nil {
				t.Errorf("docs/datapath.md, The C code: %s is not in bpf/lib/", name)
			}
		}
	}
}

// TestDocsListEveryCounter: docs/datapath.md's table of counters has one
// row per counter the datapath keeps (bpf.Counter), by the name
// datapath/counters prints, in its order, and no other.
func TestDocsListEveryCounter(t *testing.T) {
	var code, docs []string
	for c := bpf.Counter(0); c < bpf.NumCounters; c++ {
		code = append(code, c.String())
	}
	for _, row := range markdownTable(t, "docs/datapath.md", "Counters") {
		docs = append(docs, codeSpans(row[0])...)
	}
	if !slices.Equal(code, docs) {
		t.Errorf("docs/datapath.md, Counters: the table has\n\t%s\nthe datapath's counters are\n\t%s", docs, code)
	}
}

// goIdentSpan is a code span that names a Go declaration: Name, pkg.Name,
// Type.Method or pkg.Type.Method, with an exported last part.
var goIdentSpan = regexp.MustCompile(`^(?:([a-z][a-z0-9]*)\.)?(?:[A-Z][A-Za-z0-9]*\.)?([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)$`)

// TestLayoutNamesExist: every Go name docs/layout.md puts in a code span
// (`bpf.Pinned`, `NonMasqSpec`, `TestKeysComeFromRawFile`, ...) is declared
// somewhere in the module, so a renamed or removed function does not stay
// in the map of the tree. Names qualified by a package outside the module
// (`statedb.Table`) are not checked.
func TestLayoutNamesExist(t *testing.T) {
	declared, packages := map[string]bool{}, map[string]bool{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		packages[f.Name.Name] = true
		for _, decl := range f.Decls {
			switch decl := decl.(type) {
			case *ast.FuncDecl:
				declared[decl.Name.Name] = true
			case *ast.GenDecl:
				for _, s := range decl.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						declared[s.Name.Name] = true
					case *ast.ValueSpec:
						for _, n := range s.Names {
							declared[n.Name] = true
						}
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile("docs/layout.md")
	if err != nil {
		t.Fatal(err)
	}
	// The prose without its fenced blocks, whose ``` would pair with the
	// spans' backticks.
	var prose []string
	fenced := false
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
			continue
		}
		if !fenced {
			prose = append(prose, line)
		}
	}
	for _, span := range codeSpans(strings.Join(prose, " ")) {
		if m := goIdentSpan.FindStringSubmatch(span); m != nil && (m[1] == "" || packages[m[1]]) && !declared[m[2]] {
			t.Errorf("docs/layout.md names `%s`, which the module does not declare", span)
		}
	}
}

// TestRecipeNewMapIsShort: docs/layout.md's recipe for a new BPF map fed
// from a table names at most eight files, one a step, and each is in the
// tree, read with the recipe's example (<map> as nodeaddrs) and any
// header for <concern>: a recipe that grows, or names a file that moved,
// fails here.
func TestRecipeNewMapIsShort(t *testing.T) {
	data, err := os.ReadFile("docs/layout.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(data), "\n### A new BPF map fed from a table\n")
	if !ok {
		t.Fatal("docs/layout.md: no recipe \"A new BPF map fed from a table\"")
	}
	section, _, _ = strings.Cut(section, "\n### ")
	step := regexp.MustCompile(`(?m)^[0-9]+\. ` + "`" + `([^` + "`" + `]+)` + "`")
	var files []string
	for _, m := range step.FindAllStringSubmatch(section, -1) {
		files = append(files, m[1])
	}
	if len(files) == 0 || len(files) > 8 {
		t.Fatalf("the recipe names %d files (%v), want 1 to 8", len(files), files)
	}
	for _, f := range files {
		path := strings.ReplaceAll(f, "<map>", "nodeaddrs")
		if strings.Contains(path, "<concern>") {
			matches, _ := filepath.Glob(strings.ReplaceAll(path, "<concern>", "*"))
			if len(matches) == 0 {
				t.Errorf("the recipe's %s matches no file", f)
			}
			continue
		}
		if path == "testdata/nodeaddrs.txtar" {
			path = "testdata/datapath.txtar" // the recipe's example of such a test
		}
		if _, err := os.Stat(path); err != nil {
			t.Errorf("the recipe's %s: %v", f, err)
		}
	}
	if len(slices.Compact(slices.Sorted(slices.Values(files)))) != len(files) {
		t.Errorf("the recipe names a file twice: %v", files)
	}
}
