package perf

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// Comments as the Kubernetes ip-masq-agent writes them: the rules are the
// same rules it installs, match for match.
const (
	masqChain          = "IP-MASQ-AGENT"
	commentPostrouting = "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom IP-MASQ-AGENT chain"
	commentReturn      = "ip-masq-agent: local traffic is not subject to MASQUERADE"
	commentMasquerade  = "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)"
)

// ipMasqAgentRules is the nat table the Kubernetes ip-masq-agent makes for
// cidrs with masqLinkLocal false: a jump from POSTROUTING for non-local
// destinations, one RETURN per non-masquerade CIDR (link-local first), and
// MASQUERADE last. Every new connection walks the chain once.
func ipMasqAgentRules(cidrs []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:%s - [0:0]\n", masqChain)
	fmt.Fprintf(&b, "-A POSTROUTING -m comment --comment %q -m addrtype ! --dst-type LOCAL -j %s\n", commentPostrouting, masqChain)
	for _, c := range append([]string{"169.254.0.0/16"}, cidrs...) {
		fmt.Fprintf(&b, "-A %s -d %s -m comment --comment %q -j RETURN\n", masqChain, c, commentReturn)
	}
	fmt.Fprintf(&b, "-A %s -m comment --comment %q -j MASQUERADE\nCOMMIT\n", masqChain, commentMasquerade)
	return b.String()
}

// installIPMasqAgentRules loads the rules into the node namespace with one
// iptables-restore and checks the chain's length with the matching -save.
func installIPMasqAgentRules(b *testing.B, restore string, node *topology.Netns, cidrs []string) {
	b.Helper()
	cmd := exec.Command(restore)
	cmd.Stdin = strings.NewReader(ipMasqAgentRules(cidrs))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := node.Start(cmd); err != nil {
		b.Fatalf("%s: %v", restore, err)
	}
	if err := cmd.Wait(); err != nil {
		b.Fatalf("%s in the node namespace: %v\n%s", restore, err, out.String())
	}
	save := exec.Command(strings.Replace(restore, "-restore", "-save", 1), "-t", "nat")
	out.Reset()
	save.Stdout, save.Stderr = &out, &out
	if err := node.Start(save); err != nil {
		b.Fatal(err)
	}
	if err := save.Wait(); err != nil {
		b.Fatalf("iptables-save: %v\n%s", err, out.String())
	}
	if got, want := strings.Count(out.String(), "-A "+masqChain+" "), len(cidrs)+2; got != want {
		b.Fatalf("%s holds %d rules, want %d", masqChain, got, want)
	}
}
