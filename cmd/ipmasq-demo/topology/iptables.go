package topology

import (
	"bytes"
	"fmt"
	"os/exec"
)

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
