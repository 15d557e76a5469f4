package main

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// TestDocsListEveryFlag: docs/flags.md's table names every flag of
// ipmasq-agent (its first column's `--flag` spans) and no flag it lacks,
// so that a flag added, renamed or removed without its line fails here.
func TestDocsListEveryFlag(t *testing.T) {
	data, err := os.ReadFile("../../docs/flags.md")
	if err != nil {
		t.Fatal(err)
	}
	flagSpan := regexp.MustCompile("`--([a-zA-Z0-9_-]+)")
	var docs []string
	for _, line := range strings.Split(string(data), "\n") {
		if !strings.HasPrefix(line, "| ") {
			continue
		}
		first := strings.Split(strings.Trim(line, "|"), "|")[0]
		for _, m := range flagSpan.FindAllStringSubmatch(first, -1) {
			docs = append(docs, m[1])
		}
	}
	var code []string
	newRootCommand().Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name != "help" {
			code = append(code, f.Name)
		}
	})
	for _, f := range code {
		if !slices.Contains(docs, f) {
			t.Errorf("docs/flags.md: no row names --%s", f)
		}
	}
	for _, f := range docs {
		if !slices.Contains(code, f) {
			t.Errorf("docs/flags.md: --%s is not a flag of ipmasq-agent", f)
		}
	}
}
