package main

import (
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// TestUpstreamBinaryFlagsListed: testdata/upstream-flags.txt lists every
// flag the upstream binary defines, no more and no fewer: the Kubernetes
// ip-masq-agent built from its source kept in tools/ip-masq-agent (at
// upstreamPin), asked with -h. TestEveryUpstreamFlagStarts then starts
// ipmasq with each.
func TestUpstreamBinaryFlagsListed(t *testing.T) {
	if short := upstreamPin[:7]; !strings.HasSuffix(kubetest.UpstreamAgentVersion, "-g"+short) {
		t.Fatalf("tools/ip-masq-agent is %s, the flag list was read at %s: refresh one of them", kubetest.UpstreamAgentVersion, upstreamPin)
	}
	bin, err := kubetest.UpstreamAgentBinary()
	if err != nil {
		t.Fatalf("the Kubernetes ip-masq-agent: %v", err)
	}
	// Go's flag package prints its usage and exits on -h.
	out, _ := exec.Command(bin, "-h").CombinedOutput()
	var defined []string
	for _, m := range regexp.MustCompile(`(?m)^  -(\S+)`).FindAllStringSubmatch(string(out), -1) {
		defined = append(defined, m[1])
	}
	if len(defined) < 10 {
		t.Fatalf("%s -h printed %d flags:\n%s", bin, len(defined), out)
	}
	var listed []string
	for _, f := range loadUpstreamFlags(t) {
		listed = append(listed, f.name)
	}
	slices.Sort(defined)
	slices.Sort(listed)
	if !slices.Equal(defined, listed) {
		t.Fatalf("the upstream binary defines %v\n%s lists %v", defined, upstreamFlagsFile, listed)
	}
}
