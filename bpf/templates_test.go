package bpf

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// A template's definitions: a function FAM(name)(...) or a struct
// FAM_T(a, b) {...} starting a line (calls and uses are indented or follow
// other text).
var (
	templateFunc   = regexp.MustCompile(`(?m)^[A-Za-z_].*\bFAM\((\w+)\)\s*\(`)
	templateStruct = regexp.MustCompile(`(?m)^FAM_T\((\w+),\s*(\w+)\)\s*\{`)
	// A map: "} FAM(name) SEC(".maps");" closing its struct.
	templateMap = regexp.MustCompile(`(?m)^\}\s*FAM\((\w+)\)\s*SEC\(`)
	// The header comment's list: " * Defines: a_v4, a_v6, struct b_v4_c, ..."
	// over one or more lines, up to a line that is only " *" or the end.
	templateDefines = regexp.MustCompile(`(?s)\n \* Defines: (.*?)(\n \*\n|\n \*/)`)
)

// TestTemplatesNameWhatTheyDefine: the names a family template makes with
// FAM() and FAM_T() (egress_v4, struct nat_v6_key's users, the maps
// early_drop_scratch_v4/v6, ...) appear
// nowhere by name in the source, so each lib/*_fam.h lists them, both
// families spelled out, in its header comment's "Defines:" paragraph:
// `grep -rn egress_v4 bpf/` lands on the template. The list must be
// exactly what the file defines, so it cannot go stale.
func TestTemplatesNameWhatTheyDefine(t *testing.T) {
	files, err := filepath.Glob("lib/*_fam.h")
	if err != nil || len(files) == 0 {
		t.Fatalf("no lib/*_fam.h: %v", err)
	}
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var want []string
		for _, m := range templateStruct.FindAllStringSubmatch(string(src), -1) {
			want = append(want, "struct "+m[1]+"_v4_"+m[2], "struct "+m[1]+"_v6_"+m[2])
		}
		for _, m := range templateFunc.FindAllStringSubmatch(string(src), -1) {
			want = append(want, m[1]+"_v4", m[1]+"_v6")
		}
		for _, m := range templateMap.FindAllStringSubmatch(string(src), -1) {
			want = append(want, m[1]+"_v4", m[1]+"_v6")
		}
		m := templateDefines.FindStringSubmatch(string(src))
		if m == nil {
			t.Errorf("%s: no \" * Defines: ...\" paragraph in the header comment; it defines %s", f, strings.Join(want, ", "))
			continue
		}
		var got []string
		for _, name := range strings.Split(strings.NewReplacer("\n *", " ", ".", "").Replace(m[1]), ",") {
			if name = strings.Join(strings.Fields(name), " "); name != "" {
				got = append(got, name)
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: the header says it defines\n\t%s\nit defines (in this order)\n\t%s", f, strings.Join(got, ", "), strings.Join(want, ", "))
		}
	}
}
