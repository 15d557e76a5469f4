package topology

import (
	"bytes"
	"fmt"
	"net/netip"
	"os/exec"
)

// LinuxMasquerade installs the reference masquerade in the node namespace:
// Linux's own, `-t nat -A POSTROUTING -s <source> -o <out> -j MASQUERADE`
// for each source, with iptables-nft (IPv4) and ip6tables-nft (IPv6).
// Conntrack then translates replies and the ICMP errors related to each
// flow. The rules live in the namespace and go with it.
func LinuxMasquerade(node *Netns, out string, sources ...string) error {
	for _, src := range sources {
		p, err := netip.ParsePrefix(src)
		if err != nil {
			return err
		}
		tool := "iptables-nft"
		if p.Addr().Is6() {
			tool = "ip6tables-nft"
		}
		path, err := exec.LookPath(tool)
		if err != nil {
			return fmt.Errorf("the MASQUERADE reference needs %s (Debian package iptables): %w", tool, err)
		}
		cmd := exec.Command(path, "-w", "-t", "nat", "-A", "POSTROUTING", "-s", src, "-o", out, "-j", "MASQUERADE")
		var outBuf bytes.Buffer
		cmd.Stdout, cmd.Stderr = &outBuf, &outBuf
		if err := node.Start(cmd); err != nil {
			return fmt.Errorf("%s: %w", tool, err)
		}
		if err := cmd.Wait(); err != nil {
			return fmt.Errorf("%s in %s: %w: %s", tool, node.Name, err, outBuf.String())
		}
	}
	return nil
}
