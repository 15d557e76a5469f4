package config

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestDocsListEveryConfigKey: the key table of docs/config.md (the table
// whose header starts with "| key |") names every top-level key the
// decoder accepts (rawFile's json tags), and no other; the README's, the
// front page's short list, names only keys the decoder accepts.
func TestDocsListEveryConfigKey(t *testing.T) {
	want := slices.Sorted(slices.Values(jsonKeys[rawFile]()))
	for _, doc := range []string{"../../docs/config.md", "../../README.md"} {
		data, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		_, table, ok := strings.Cut(string(data), "\n| key |")
		if !ok {
			t.Fatalf("%s: no table with a header starting | key |", doc)
		}
		var got []string
		for _, line := range strings.Split(table, "\n")[2:] {
			if !strings.HasPrefix(line, "|") {
				break
			}
			first := strings.SplitN(line, "|", 3)[1]
			for _, m := range regexp.MustCompile("`([A-Za-z0-9]+)`").FindAllStringSubmatch(first, -1) {
				got = append(got, m[1])
			}
		}
		slices.Sort(got)
		if strings.HasSuffix(doc, "README.md") {
			for _, k := range got {
				if !slices.Contains(want, k) {
					t.Errorf("%s: the key table names %s, which the decoder does not accept (%q)", doc, k, want)
				}
			}
			continue
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: the key table names %q; the decoder accepts %q", doc, got, want)
		}
	}
}
