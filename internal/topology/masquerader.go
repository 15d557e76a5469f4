package topology

import (
	"bytes"
	"fmt"
	"os/exec"
	"testing"
)

// A Masquerader is what translates the pods' traffic on the node of a
// Masquerade topology: ipmasq, or Linux's own MASQUERADE as the reference
// ipmasq must match. Tests run one scenario under each with [RunEach].
type Masquerader struct {
	// Name names the subtest, e.g. "ipmasq" or "MASQUERADE".
	Name string
	// Start makes the node masquerade the pod CIDRs leaving eth0. It fails
	// the test when it cannot; cleanup is registered on tb.
	Start func(tb testing.TB, topo *Masquerade)
}

// LinuxMasquerade is the reference: iptables-nft MASQUERADE in the node
// namespace, as the Kubernetes ip-masq-agent's last rule, for both
// families, with conntrack's default behaviour (only flows started by a
// pod are translated; replies follow their connection).
var LinuxMasquerade = Masquerader{
	Name: "MASQUERADE",
	Start: func(tb testing.TB, topo *Masquerade) {
		tb.Helper()
		for _, r := range []struct {
			v6  bool
			src string
		}{{false, PodCIDR4}, {true, PodCIDR6}} {
			if err := topo.Node.Iptables(r.v6, "-t", "nat", "-A", "POSTROUTING", "-s", r.src, "-o", "eth0", "-j", "MASQUERADE"); err != nil {
				tb.Fatal(err)
			}
		}
	},
}

// RunEach runs scenario as one subtest per masquerader, each on a topology
// of its own. A scenario that fails under the reference proves nothing
// about the others: the test fails either way, and the subtest names say
// which one broke.
func RunEach(t *testing.T, ms []Masquerader, scenario func(t *testing.T, topo *Masquerade)) {
	t.Helper()
	for _, m := range ms {
		t.Run(m.Name, func(t *testing.T) {
			topo, err := NewMasquerade()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { topo.Close() })
			m.Start(t, topo)
			scenario(t, topo)
		})
	}
}

// Iptables runs iptables-nft (ip6tables-nft when v6) with args in the
// namespace. The rules live and die with the namespace.
func (n *Netns) Iptables(v6 bool, args ...string) error {
	bin := "iptables-nft"
	if v6 {
		bin = "ip6tables-nft"
	}
	path, err := exec.LookPath(bin)
	if err != nil {
		return fmt.Errorf("%s is needed (Debian package iptables): %w", bin, err)
	}
	cmd := exec.Command(path, append([]string{"-w"}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := n.Start(cmd); err != nil {
		return fmt.Errorf("%s: %s %v: %w", n.Name, bin, args, err)
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("%s: %s %v: %w: %s", n.Name, bin, args, err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}
