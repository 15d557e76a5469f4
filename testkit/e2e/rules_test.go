package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// rulesSetup is the tunnel scenario: a client namespace (192.168.6.1,
// fd00:6::1) behind wg0 on the node, the node's eth0 10.0.0.5, and the load
// balancer ext (10.0.0.2) with no route to the client prefixes unless
// routeBack.
func rulesSetup(t *testing.T, config string, routeBack bool, agentArgs ...string) (*topology.Masquerade, *agent, *servers) {
	t.Helper()
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	if _, err := topo.AddTunnelClient(); err != nil {
		t.Fatal(err)
	}
	if routeBack {
		if err := topo.Ext.Route(topology.ClientCIDR4, "10.0.0.5", "eth0"); err != nil {
			t.Fatal(err)
		}
		if err := topo.Ext.Route(topology.ClientCIDR6, "2001:db8::5", "eth0"); err != nil {
			t.Fatal(err)
		}
	}
	ext := startServers(t, topo.Ext, topology.ExtIP4, topology.ExtIP6, topology.RemoteIP4, topology.RemoteIP6)
	a := newAgent(t, topo.Node, config)
	a.args = agentArgs
	a.start()
	// wg0's subnet is a route the node forwards through: it gets the
	// programs too, and a flow in flight as they attach would have no
	// inbound record for its replies.
	a.waitAttached("wg0")
	return topo, a, ext
}

const wgRule = `
masqueradeRules:
  - name: wg-clients
    sources: [192.168.6.0/24, fd00:6::/64]
    outInterfaces: [eth0]
`

// clientSources checks what ext sees for flows of every protocol from the
// tunnel client.
func clientSources(t *testing.T, topo *topology.Masquerade, ext *servers, dst, want netip.Addr, flows int) {
	t.Helper()
	pod := topo.Pod
	topo.Pod = topo.Client
	defer func() { topo.Pod = pod }()
	checkSource(t, topo, ext, dst, want, flows)
}

// TestRuleMasqueradesTunnelClients: with the rule, 20 pings, TCP and UDP
// flows from the client succeed and the load balancer sees the node's
// address for all of them, IPv4 and IPv6 (it has no route back).
func TestRuleMasqueradesTunnelClients(t *testing.T) {
	topo, _, ext := rulesSetup(t, "nonMasqueradeCIDRs: []\n"+wgRule, false)
	clientSources(t, topo, ext, topology.ExtIP4, topology.NodeIP4, 20)
	clientSources(t, topo, ext, topology.ExtIP6, topology.NodeIP6, 20)
}

// TestRuleNotInForce: with the masquerade sources restricted to the pod
// CIDRs (--masquerade-pod-cidrs-only), without the rule the client is not
// masqueraded (ext sees 192.168.6.1 over its route back), nor with the
// destination in nonMasqueradeCIDRs; adding and removing the rule while
// the agent runs flips it for new flows. (By default every source is
// masqueraded: TestTunnelClientsWithoutRule.)
func TestRuleNotInForce(t *testing.T) {
	topo, a, ext := rulesSetup(t, "nonMasqueradeCIDRs: []\n", true, "--masquerade-pod-cidrs-only")
	clientSources(t, topo, ext, topology.ExtIP4, topology.ClientIP4, 5)
	clientSources(t, topo, ext, topology.ExtIP6, topology.ClientIP6, 5)

	a.writeConfig("nonMasqueradeCIDRs: []\n" + wgRule)
	a.waitRuleSources(2)
	clientSources(t, topo, ext, topology.ExtIP4, topology.NodeIP4, 5)
	clientSources(t, topo, ext, topology.ExtIP6, topology.NodeIP6, 5)

	a.writeConfig("nonMasqueradeCIDRs: [10.0.0.0/24, 2001:db8::/64]\n" + wgRule)
	a.waitMaps("nonmasq_v4 10.0.0.0/24 no-masquerade\nnonmasq_v4 169.254.0.0/16 no-masquerade\nnonmasq_v6 2001:db8::/64 no-masquerade\nnonmasq_v6 fe80::/10 no-masquerade\n")
	clientSources(t, topo, ext, topology.ExtIP4, topology.ClientIP4, 5)
	clientSources(t, topo, ext, topology.ExtIP6, topology.ClientIP6, 5)
	// Outside the non-masquerade range the rule still applies.
	clientSources(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 5)

	a.writeConfig("nonMasqueradeCIDRs: []\n")
	a.waitRuleSources(0)
	clientSources(t, topo, ext, topology.ExtIP4, topology.ClientIP4, 5)
}

// TestRuleDeviceAppearsLater: a rule for eth1 written before eth1 exists
// takes effect when it appears (eth1 gets the programs, for the rule and
// for its subnet's route).
func TestRuleDeviceAppearsLater(t *testing.T) {
	topo, a, _ := rulesSetup(t, "nonMasqueradeCIDRs: []\nmasqueradeRules:\n  - name: wg-eth1\n    sources: [192.168.6.0/24]\n    outInterfaces: [eth1]\n", false)
	a.waitRuleSources(0)
	// A second uplink node eth1 (10.1.0.5) ↔ ext eth1 (10.1.0.2).
	if err := topology.Veth(topo.Node, "eth1", topo.Ext, "eth1", 0); err != nil {
		t.Fatal(err)
	}
	for _, step := range []func() error{
		func() error { return topo.Node.Addr("eth1", "10.1.0.5/24") },
		func() error { return topo.Ext.Addr("eth1", "10.1.0.2/24") },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	// ext's TCP server listens on all its addresses, 10.1.0.2 included.
	a.waitRuleSources(1)
	for i := range 5 {
		seen, err := tcpSource(topo.Client, netip.MustParseAddr("10.1.0.2"))
		if err != nil || seen != "10.1.0.5" {
			t.Fatalf("flow %d through eth1: server saw %q (%v), want 10.1.0.5", i, seen, err)
		}
	}
}

// TestRuleToAddress: toAddress picks the SNAT address; an address the node
// does not have puts the rule out of force (reported) while other rules keep
// working.
func TestRuleToAddress(t *testing.T) {
	topo, a, ext := rulesSetup(t, "nonMasqueradeCIDRs: []\n", false)
	if err := topo.Node.Addr("eth0", "10.0.0.6/24"); err != nil {
		t.Fatal(err)
	}
	a.writeConfig(`nonMasqueradeCIDRs: []
masqueradeRules:
  - name: wg-v4
    sources: [192.168.6.0/24]
    outInterfaces: [eth0]
    toAddress: 10.0.0.6
  - name: wg-v6
    sources: [fd00:6::/64]
    outInterfaces: [eth0]
`)
	a.waitRuleSources(2)
	clientSources(t, topo, ext, topology.ExtIP4, netip.MustParseAddr("10.0.0.6"), 10)
	clientSources(t, topo, ext, topology.ExtIP6, topology.NodeIP6, 5)

	// The address goes away: the rule is reported and left out; wg-v6 works.
	l, _ := topo.Node.NL.LinkByName("eth0")
	addrs, _ := topo.Node.NL.AddrList(l, 2 /* AF_INET */)
	for _, ad := range addrs {
		if ad.IP.String() == "10.0.0.6" {
			if err := topo.Node.NL.AddrDel(l, &ad); err != nil {
				t.Fatal(err)
			}
		}
	}
	a.waitRuleSources(1)
	if _, err := a.waitLogLine(`masquerade rule \"wg-v4\": toAddress 10.0.0.6 is not an address of this node`); err != nil {
		t.Fatal(err)
	}
	clientSources(t, topo, ext, topology.ExtIP6, topology.NodeIP6, 5)
}

// waitRuleSources waits until the datapath applies n rule sources: the
// rule maps hold n entries and masq_src_v4/v6 send each one's source to
// them (MasqSrcRules). Two reconcilers write these maps, each in its own
// time, and a flow sent while only one of them holds a new rule still
// leaves by the old decision.
func (a *agent) waitRuleSources(n int) {
	a.t.Helper()
	a.waitFor(fmt.Sprintf("%d rule source(s) in the maps", n), func() bool {
		sources := a.ruleSources()
		if len(sources) != n {
			return false
		}
		for _, src := range sources {
			if !a.sourceLooksUpRules(src) {
				return false
			}
		}
		return true
	})
}

// ruleSources lists the source prefixes of the pinned rule maps' entries,
// one per entry.
func (a *agent) ruleSources() []netip.Prefix {
	var sources []netip.Prefix
	v4, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", bpf.MapMasqRulesV4), nil)
	if err != nil {
		a.t.Fatal(err)
	}
	defer v4.Close()
	var k4 bpf.MasqRuleKeyV4
	var rule bpf.MasqRule
	for it := v4.Iterate(); it.Next(&k4, &rule); {
		sources = append(sources, k4.Source())
	}
	v6, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", bpf.MapMasqRulesV6), nil)
	if err != nil {
		a.t.Fatal(err)
	}
	defer v6.Close()
	var k6 bpf.MasqRuleKeyV6
	for it := v6.Iterate(); it.Next(&k6, &rule); {
		sources = append(sources, k6.Source())
	}
	return sources
}

// sourceLooksUpRules reports whether the masq_src entry covering src has
// MasqSrcRules.
func (a *agent) sourceLooksUpRules(src netip.Prefix) bool {
	var name string
	var key any
	if src.Addr().Is4() {
		name, key = bpf.MapMasqSrcV4, bpf.LPMKeyV4From(src)
	} else {
		name, key = bpf.MapMasqSrcV6, bpf.LPMKeyV6From(src)
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", name), nil)
	if err != nil {
		a.t.Fatal(err)
	}
	defer m.Close()
	var flags uint8
	if err := m.Lookup(key, &flags); err != nil {
		return false
	}
	return flags&bpf.MasqSrcRules != 0
}

// logLines counts the lines of the agent's log (all its runs) holding s.
func (a *agent) logLines(s string) int {
	data, err := os.ReadFile(a.log)
	if err != nil {
		a.t.Fatal(err)
	}
	return strings.Count(string(data), s)
}

func (a *agent) waitLogLine(s string) (string, error) {
	var line string
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		data, _ := os.ReadFile(a.log)
		for _, l := range strings.Split(string(data), "\n") {
			if strings.Contains(l, s) {
				return l, nil
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	return line, os.ErrNotExist
}
