package nodee2e

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"
)

// TestRealNode runs ipmasq on a real node: a kubelet and containerd run
// the agent's image from deploy/ as an operator applies it, and pods the
// kubelet starts get their addresses from ipmasq-cni and are masqueraded.
func TestRealNode(t *testing.T) {
	begin := time.Now()
	c := startCluster(t)

	// 1. deploy/ as shipped, but for the image: the agent's pod becomes
	// Ready through its own readiness probe (/healthz).
	step := time.Now()
	c.deployAgent(agentImageV1)
	c.agentPod(90 * time.Second)
	t.Logf("agent Ready in %v", time.Since(step).Round(time.Millisecond))

	// 2. Three ordinary pods on ipmasq's CNI: addresses from the Node's pod
	// CIDR, never its network or gateway address, none twice.
	step = time.Now()
	cidr := c.podCIDR()
	gateway := cidr.Addr().Next()
	dial := []string{"dial", masqDial, plainDial}
	ips := map[string]netip.Addr{}
	for i := range 3 {
		name := fmt.Sprintf("client-%d", i)
		p := c.runPod(name, dial...)
		ip := netip.MustParseAddr(p.Status.PodIP)
		if !cidr.Contains(ip) || ip == cidr.Addr() || ip == gateway {
			t.Errorf("pod %s has %s: want an address of %s other than its network and gateway %s", name, ip, cidr, gateway)
		}
		for other, o := range ips {
			if o == ip {
				t.Errorf("pods %s and %s both have %s", name, other, ip)
			}
		}
		ips[name] = ip
	}
	t.Logf("3 pods Running in %v: %v", time.Since(step).Round(time.Millisecond), ips)

	// 3. Each holds an allocation of the agent, and has its per-endpoint
	// ip rules: one per non-masquerade CIDR, into the CNI config's table.
	allocs := c.allocations()
	for name, ip := range ips {
		i := slices.IndexFunc(allocs, func(a allocation) bool { return a.IP == ip })
		if i < 0 {
			t.Fatalf("pod %s's %s is not an allocation of the agent: %v", name, ip, allocs)
		}
		cidrs := allocs[i].NonMasqueradeCIDRs
		if !slices.Contains(cidrs, netip.MustParsePrefix("10.0.0.0/8")) {
			t.Fatalf("allocation %v: want deploy/configmap.yaml's 10.0.0.0/8 among its non-masquerade CIDRs", allocs[i])
		}
		var want []string
		for _, p := range cidrs {
			if p.Addr().Is4() {
				want = append(want, fmt.Sprintf("111: to %s lookup %s", p, routeTable))
			}
		}
		slices.Sort(want)
		if got := c.rulesFrom(ip); !slices.Equal(got, want) {
			t.Errorf("pod %s (%s): ip rules\n%v\nwant\n%v", name, ip, got, want)
		}
	}

	// 4. Traffic: to the masqueraded destination it arrives from the
	// node's address, to the non-masquerade one (reachable only through
	// the rules' table) from the pod's own.
	node := netip.MustParseAddr(nodeIP)
	for name, ip := range ips {
		c.eventually(20*time.Second, name+"'s connections at the external host", func() error {
			m, p := c.seen.sources(name, masqDial), c.seen.sources(name, plainDial)
			if len(m) == 0 || len(p) == 0 {
				return fmt.Errorf("masqueraded from %v, plain from %v", m, p)
			}
			return nil
		})
		for from, n := range c.seen.sources(name, masqDial) {
			if from != node {
				t.Errorf("pod %s (%s): %d connections to %s arrived from %s, want the node's %s", name, ip, n, masqTarget, from, node)
			}
		}
		for from, n := range c.seen.sources(name, plainDial) {
			if from != ip {
				t.Errorf("pod %s (%s): %d connections to %s arrived from %s, want the pod's own address", name, ip, n, plainTarget, from)
			}
		}
	}

	// 5. kubectl delete pod: the kubelet's CNI DEL releases the address
	// and the agent removes its rules; the other pods keep theirs.
	gone := ips["client-2"]
	c.deletePod("default", "client-2")
	if slices.ContainsFunc(c.allocations(), func(a allocation) bool { return a.IP == gone }) {
		t.Errorf("%s of the deleted pod is still allocated", gone)
	}
	c.eventually(10*time.Second, "the deleted pod's ip rules removed", func() error {
		if r := c.rulesFrom(gone); len(r) > 0 {
			return fmt.Errorf("rules from %s: %v", gone, r)
		}
		return nil
	})
	for _, name := range []string{"client-0", "client-1"} {
		if !slices.ContainsFunc(c.allocations(), func(a allocation) bool { return a.IP == ips[name] }) {
			t.Errorf("%s of pod %s is no longer allocated after another pod's delete", ips[name], name)
		}
	}
	t.Logf("items 1-3 done in %v", time.Since(begin).Round(time.Millisecond))

	testDay2(t, c)
	testUninstall(t, c, agentImageV2)
	t.Logf("whole test %v", time.Since(begin).Round(time.Millisecond))
}
