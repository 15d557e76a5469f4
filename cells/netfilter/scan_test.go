package netfilter

import (
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

var podCIDRs = []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24"), netip.MustParsePrefix("fd00:244::/64")}

// scanIn scans ns the way the agent scans its own namespace.
func scanIn(t *testing.T, ns *topology.Netns, sources []netip.Prefix) []string {
	t.Helper()
	var rows []*tables.NetfilterNATRule
	if err := ns.Do(func() (err error) {
		rows, err = Scan("/proc/thread-self/net", sources)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range rows {
		out = append(out, strings.Join(slices.Delete(r.TableRow(), 3, 4), " ")) // without the handle
	}
	slices.Sort(out)
	return out
}

func newNetns(t *testing.T) *topology.Netns {
	t.Helper()
	privtest.Require(t)
	ns, err := topology.NewNetns("netfilter")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.Close)
	return ns
}

func iptables(t *testing.T, ns *topology.Netns, v6 bool, args ...string) {
	t.Helper()
	if err := ns.Iptables(v6, args...); err != nil {
		t.Fatal(err)
	}
}

// TestCleanNamespaceReportsNothing: a namespace without NAT rules, and one
// with only rules that cannot decide for a pod (other sources, DNAT,
// filter, kube-proxy's mark-gated MASQUERADE), report nothing.
func TestCleanNamespaceReportsNothing(t *testing.T) {
	ns := newNetns(t)
	if got := scanIn(t, ns, podCIDRs); len(got) != 0 {
		t.Fatalf("clean namespace: %q", got)
	}
	// A nat table with rules for other sources, a DNAT and a filter rule.
	iptables(t, ns, false, "-t", "nat", "-A", "POSTROUTING", "-s", "192.168.6.0/24", "-o", "eth0", "-j", "MASQUERADE")
	iptables(t, ns, false, "-t", "nat", "-A", "POSTROUTING", "-s", "10.244.0.0/24", "-j", "SNAT", "--to-source", "10.0.0.5")
	iptables(t, ns, false, "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", "80", "-j", "DNAT", "--to-destination", "10.0.0.9")
	iptables(t, ns, false, "-A", "FORWARD", "-j", "ACCEPT")
	iptables(t, ns, true, "-t", "nat", "-A", "POSTROUTING", "-s", "fd00:245::/64", "-j", "MASQUERADE")
	// kube-proxy's chain, as it writes it: MASQUERADE only for the Service
	// traffic it marked, which a pod's own traffic is not.
	iptables(t, ns, false, "-t", "nat", "-N", "KUBE-POSTROUTING")
	iptables(t, ns, false, "-t", "nat", "-A", "POSTROUTING", "-m", "comment", "--comment", "kubernetes postrouting rules", "-j", "KUBE-POSTROUTING")
	iptables(t, ns, false, "-t", "nat", "-A", "KUBE-POSTROUTING", "-m", "mark", "!", "--mark", "0x4000/0x4000", "-j", "RETURN")
	iptables(t, ns, false, "-t", "nat", "-A", "KUBE-POSTROUTING", "-j", "MARK", "--xor-mark", "0x4000")
	iptables(t, ns, false, "-t", "nat", "-A", "KUBE-POSTROUTING", "-m", "comment", "--comment", "kubernetes service traffic requiring SNAT", "-j", "MASQUERADE", "--random-fully")
	// A MASQUERADE conditioned on a mark (packet or connection).
	iptables(t, ns, false, "-t", "nat", "-A", "POSTROUTING", "-m", "mark", "--mark", "0x1/0x1", "-j", "MASQUERADE")
	iptables(t, ns, false, "-t", "nat", "-A", "POSTROUTING", "-m", "connmark", "--mark", "0x2", "-j", "MASQUERADE")
	if got := scanIn(t, ns, podCIDRs); len(got) != 0 {
		t.Fatalf("rules that cannot decide for a pod reported: %q", got)
	}
}

// TestUpstreamChainAndMasqueradeRules: the Kubernetes agent's chain, as it
// writes it, and plain MASQUERADE/SNAT rules for every source or a pod's.
func TestUpstreamChainAndMasqueradeRules(t *testing.T) {
	ns := newNetns(t)
	for _, v6 := range []bool{false, true} {
		iptables(t, ns, v6, "-t", "nat", "-N", "IP-MASQ-AGENT")
		iptables(t, ns, v6, "-t", "nat", "-A", "POSTROUTING", "-m", "comment", "--comment", "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom IP-MASQ-AGENT chain",
			"-m", "addrtype", "!", "--dst-type", "LOCAL", "-j", "IP-MASQ-AGENT")
	}
	iptables(t, ns, false, "-t", "nat", "-A", "IP-MASQ-AGENT", "-d", "169.254.0.0/16", "-j", "RETURN")
	iptables(t, ns, false, "-t", "nat", "-A", "IP-MASQ-AGENT", "-d", "10.0.0.0/8", "-j", "RETURN")
	iptables(t, ns, false, "-t", "nat", "-A", "IP-MASQ-AGENT", "-j", "MASQUERADE", "--random-fully")
	iptables(t, ns, true, "-t", "nat", "-A", "IP-MASQ-AGENT", "-d", "fe80::/10", "-j", "RETURN")
	iptables(t, ns, true, "-t", "nat", "-A", "IP-MASQ-AGENT", "-j", "MASQUERADE")
	// Plain rules: a cluster range holding the pod CIDR, a pod CIDR's
	// part, a negated match, an SNAT without source match.
	iptables(t, ns, false, "-t", "nat", "-A", "POSTROUTING", "-s", "10.244.0.0/16", "!", "-d", "10.0.0.0/8", "-j", "MASQUERADE")
	iptables(t, ns, false, "-t", "nat", "-A", "POSTROUTING", "-s", "10.244.1.128/25", "-o", "eth0", "-j", "MASQUERADE")
	iptables(t, ns, false, "-t", "nat", "-A", "POSTROUTING", "!", "-s", "192.168.0.0/16", "-j", "MASQUERADE")
	iptables(t, ns, true, "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "SNAT", "--to-source", "2001:db8::5")

	want := []string{
		"ip nat IP-MASQ-AGENT ip-masq-agent-chain ",
		"ip nat IP-MASQ-AGENT masquerade any",
		"ip nat POSTROUTING masquerade 10.244.0.0/16",
		"ip nat POSTROUTING masquerade 10.244.1.128/25",
		"ip nat POSTROUTING masquerade not 192.168.0.0/16",
		"ip6 nat IP-MASQ-AGENT ip-masq-agent-chain ",
		"ip6 nat IP-MASQ-AGENT masquerade any",
		"ip6 nat POSTROUTING snat any",
	}
	if got := scanIn(t, ns, podCIDRs); !slices.Equal(got, want) {
		t.Fatalf("got\n %q\nwant\n %q", got, want)
	}
}

// TestLegacyNATTable: iptables-legacy rules are not on nftables' netlink
// API; a legacy nat table is reported as present.
func TestLegacyNATTable(t *testing.T) {
	ns := newNetns(t)
	path, err := exec.LookPath("iptables-legacy")
	if err != nil {
		t.Fatalf("iptables-legacy is needed (Debian package iptables): %v", err)
	}
	cmd := exec.Command(path, "-w", "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE")
	if err := ns.Start(cmd); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("iptables-legacy: %v", err)
	}
	want := []string{"legacy-ipv4 nat  legacy-nat-table "}
	if got := scanIn(t, ns, podCIDRs); !slices.Equal(got, want) {
		t.Fatalf("got %q, want %q", got, want)
	}
}
