package nodee2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// calicoBlock is the pods' address block on the node under the foreign
// CNI: a /26 as Calico's IPAM hands a node, inside the cluster's range
// but outside the /24 the controller manager puts in the Node's
// spec.podCIDRs (the first /24 of clusterCIDR), and named to ipmasq
// nowhere.
const calicoBlock = "10.244.183.192/26"

// debianCNI is where Debian's containernetworking-plugins puts the
// upstream plugins.
const debianCNI = "/usr/lib/cni"

// installBridgeCNI is a pod network that is not ipmasq's: Debian's
// upstream bridge plugin with host-local IPAM on calicoBlock, the
// bridge's own masquerade off (ipMasq false: only ipmasq may translate).
func (c *cluster) installBridgeCNI() {
	t := c.t
	for _, plugin := range []string{"bridge", "host-local", "loopback"} {
		data, err := os.ReadFile(filepath.Join(debianCNI, plugin))
		if err != nil {
			t.Fatalf("%v: the Debian package containernetworking-plugins has the upstream %s plugin", err, plugin)
		}
		c.node.WriteFile("/opt/cni/bin/"+plugin, data, 0o755)
	}
	conf, err := json.MarshalIndent(map[string]any{
		"cniVersion": "1.0.0",
		"name":       "pods",
		"plugins": []any{map[string]any{
			"type":        "bridge",
			"bridge":      "cni0",
			"isGateway":   true,
			"ipMasq":      false,
			"hairpinMode": true,
			"ipam": map[string]any{
				"type":   "host-local",
				"ranges": [][]map[string]string{{{"subnet": calicoBlock}}},
				"routes": []map[string]string{{"dst": "0.0.0.0/0"}},
			},
		}},
	}, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	c.node.WriteFile("/etc/cni/net.d/10-bridge.conflist", conf, 0o644)
}

// TestRealNodeForeignCNI is the install of an operator whose pods are
// addressed by a CNI that is not ipmasq's, outside the Node's
// spec.podCIDRs, and who names no pod range to ipmasq: the image plain
// `make image` built, imported on the node, and `kubectl apply -k
// deploy/` with no edit and no overlay. Before the agent, a pod's
// connections leave with its own address (the CNI masquerades nothing);
// with it, the pods' connections to an external host arrive from the
// node's address, and those to a non-masquerade range (deploy/config's
// 10.0.0.0/8) from the pod's.
func TestRealNodeForeignCNI(t *testing.T) {
	begin := time.Now()
	c := startClusterWith(t, "", (*cluster).installBridgeCNI)
	block := netip.MustParsePrefix(calicoBlock)
	podCIDR := c.podCIDR()
	if podCIDR.Overlaps(block) {
		t.Fatalf("the Node's pod CIDR %s overlaps the CNI's block %s: the test needs pods outside spec.podCIDRs", podCIDR, block)
	}
	node := netip.MustParseAddr(nodeIP)

	// 1. The reference: with no agent, the CNI translates nothing.
	dial := []string{"dial", masqDial, plainDial}
	before := c.runPod("before", dial...)
	beforeIP := netip.MustParseAddr(before.Status.PodIP)
	if !block.Contains(beforeIP) {
		t.Fatalf("pod before has %s, want an address of the CNI's block %s", beforeIP, block)
	}
	c.eventually(20*time.Second, "pod before's connections at the external host, from its own address", func() error {
		if m := c.seen.sources("before", masqDial); m[beforeIP] == 0 {
			return fmt.Errorf("connections to %s from %v", masqDial, m)
		}
		return nil
	})
	if m := c.seen.sources("before", masqDial); m[node] > 0 {
		t.Fatalf("without ipmasq, %d of pod before's connections to %s arrived from the node: something else masquerades", m[node], masqDial)
	}

	// 2. The install: deploy/ as shipped, the image as `make image` named
	// it. The agent's pod becomes Ready through its readiness probe.
	step := time.Now()
	c.deployAgent("")
	agent := c.agentPod(90 * time.Second)
	if got := agent.Spec.Containers[0].Image; got != defaultImage(t) {
		t.Fatalf("the agent runs %s, want %s as deploy/ names it", got, defaultImage(t))
	}
	t.Logf("agent Ready in %v (%s)", time.Since(step).Round(time.Millisecond), agent.Spec.Containers[0].Image)

	// 3. Pods started after it, and the one started before: to the
	// external host from the node, to 10.0.0.0/8 from their own address.
	ips := map[string]netip.Addr{"before": beforeIP}
	for i := range 2 {
		name := fmt.Sprintf("client-%d", i)
		ip := netip.MustParseAddr(c.runPod(name, dial...).Status.PodIP)
		if !block.Contains(ip) || podCIDR.Contains(ip) {
			t.Fatalf("pod %s has %s: want an address of %s, outside the Node's %s", name, ip, block, podCIDR)
		}
		ips[name] = ip
	}
	start := c.seen.sources("before", masqDial)
	for name, ip := range ips {
		c.eventually(20*time.Second, name+"'s connections from the node and from itself", func() error {
			m, p := c.seen.sources(name, masqDial), c.seen.sources(name, plainDial)
			if m[node] <= start[node] || p[ip] == 0 {
				return fmt.Errorf("to %s from %v, to %s from %v", masqDial, m, plainDial, p)
			}
			return nil
		})
		for from, n := range c.seen.sources(name, plainDial) {
			if from != ip {
				t.Errorf("pod %s (%s): %d connections to %s arrived from %s, want the pod's own address", name, ip, n, plainTarget, from)
			}
		}
		if name == "before" {
			continue
		}
		for from, n := range c.seen.sources(name, masqDial) {
			if from != node {
				t.Errorf("pod %s (%s): %d connections to %s arrived from %s, want the node's %s", name, ip, n, masqTarget, from, node)
			}
		}
	}
	// The pod started before the agent: once it masquerades, no new
	// connection leaves with the pod's address.
	settled := c.seen.sources("before", masqDial)
	time.Sleep(2 * time.Second)
	if now := c.seen.sources("before", masqDial); now[beforeIP] != settled[beforeIP] || now[node] <= settled[node] {
		t.Errorf("pod before's connections to %s over 2 s: from its own address %d -> %d, from the node %d -> %d; want only the node's to grow",
			masqTarget, settled[beforeIP], now[beforeIP], settled[node], now[node])
	}
	t.Logf("whole test %v", time.Since(begin).Round(time.Millisecond))
}

// defaultImage is the reference deploy/image/kustomization.yaml gives the
// agent: what plain `make image` tags and `kubectl apply -k deploy/` runs.
func defaultImage(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("../../deploy/image/kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Images []struct{ NewName, NewTag string }
	}
	if err := yaml.Unmarshal(data, &k); err != nil || len(k.Images) != 1 {
		t.Fatalf("deploy/image/kustomization.yaml: %v, %d images: entries, want one", err, len(k.Images))
	}
	return k.Images[0].NewName + ":" + k.Images[0].NewTag
}
