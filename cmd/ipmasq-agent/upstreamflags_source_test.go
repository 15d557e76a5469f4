//go:build upstream_source

package main

import (
	"flag"
	"os"
	"testing"
)

var updateUpstreamFlags = flag.Bool("update-upstream-flags", false, "rewrite "+upstreamFlagsFile+" from the upstream source")

// TestUpstreamFlagsMatchSource: the committed list is the upstream
// binary's flags, read from a clone of its source ($IPMASQ_UPSTREAM_GIT, or
// the fetch tool's mirror). The Go module proxy does not serve
// k8s.io/ip-masq-agent, so a clean machine has no source to read: this
// check is how the committed list is made and refreshed, behind the build
// tag upstream_source, and every `go test` uses the committed list
// (TestEveryUpstreamFlagStarts):
//
//	IPMASQ_UPSTREAM_GIT=<clone>/.git go test -tags upstream_source \
//	    -run TestUpstreamFlagsMatchSource ./cmd/ipmasq-agent/ [-update-upstream-flags]
func TestUpstreamFlagsMatchSource(t *testing.T) {
	gitDir := upstreamGitDir()
	if _, err := os.Stat(gitDir); err != nil {
		t.Fatalf("no clone of kubernetes-sigs/ip-masq-agent at %s (set IPMASQ_UPSTREAM_GIT): the committed %s cannot be checked against the source",
			gitDir, upstreamFlagsFile)
	}
	flags, err := readUpstreamFlags(gitDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(flags) < 20 {
		t.Fatalf("read only %d flags from the source: %v", len(flags), flags)
	}
	want := formatUpstreamFlags(flags)
	if *updateUpstreamFlags {
		if err := os.WriteFile(upstreamFlagsFile, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(upstreamFlagsFile)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatalf("%s differs from the flags of the source at %s (rerun with -update-upstream-flags):\n%s", upstreamFlagsFile, upstreamPin, want)
	}
}
