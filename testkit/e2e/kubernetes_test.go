package e2e

import (
	"context"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/readers/nodeevents"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// clusterConfig is the same ip-masq-agent file on every node: the cluster's
// pod range is not masqueraded, everything else is.
const clusterConfig = "nonMasqueradeCIDRs: [10.244.0.0/16]\nmasqLinkLocal: false\n"

// daemonSetAgent is what deploy/daemonset.yaml runs: its container's
// command and args, and its environment (values and downward-API fields).
type daemonSetAgent struct {
	args []string
	env  []corev1.EnvVar
}

func loadDaemonSet(t *testing.T) daemonSetAgent {
	t.Helper()
	data, err := os.ReadFile("../../deploy/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var ds appsv1.DaemonSet
		if err := yaml.Unmarshal([]byte(doc), &ds); err != nil {
			t.Fatalf("deploy/daemonset.yaml: %v", err)
		}
		if ds.Kind != "DaemonSet" {
			continue
		}
		for _, c := range ds.Spec.Template.Spec.Containers {
			if c.Name == "ipmasq-agent" {
				return daemonSetAgent{args: append(c.Command[1:], c.Args...), env: c.Env}
			}
		}
	}
	t.Fatal("deploy/daemonset.yaml: no DaemonSet with an ipmasq-agent container")
	return daemonSetAgent{}
}

// k8sAgent is ipmasq-agent running in a node namespace exactly as the
// DaemonSet runs it: the DaemonSet's flags, with its host paths moved under
// the node's own directory (each "node" here shares one host), the
// kubeconfig standing in for the in-cluster config, and K8S_NODE_NAME as
// the downward API would set it. No node-specific flag.
type k8sAgent struct {
	t       *testing.T
	cn      *topology.ClusterNode
	dir     string
	bpfRoot string
	args    []string
	env     []string
	cmd     *exec.Cmd
}

func newK8sAgent(t *testing.T, ds daemonSetAgent, cn *topology.ClusterNode, kubeconfig string) *k8sAgent {
	a := &k8sAgent{t: t, cn: cn, dir: t.TempDir(), bpfRoot: privtest.MountBPFFS(t)}
	hostPaths := strings.NewReplacer(
		"=/etc/config/", "="+filepath.Join(a.dir, "config")+"/",
		"=/sys/fs/bpf", "="+a.bpfRoot,
		"=/var/lib/ipmasq", "="+filepath.Join(a.dir, "state"),
		"=/run/ipmasq/", "="+a.dir+"/",
	)
	for _, arg := range ds.args {
		a.args = append(a.args, hostPaths.Replace(arg))
	}
	a.args = append(a.args, "--k8s-kubeconfig-path="+kubeconfig, "--log-level=debug")
	for _, e := range ds.env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName":
			a.env = append(a.env, e.Name+"="+cn.Name)
		case e.ValueFrom == nil:
			a.env = append(a.env, e.Name+"="+e.Value)
		default:
			t.Fatalf("deploy/daemonset.yaml: env %s: a source this test does not emulate", e.Name)
		}
	}
	if err := os.MkdirAll(filepath.Join(a.dir, "config"), 0o755); err != nil {
		t.Fatal(err)
	}
	a.writeConfig(clusterConfig)
	t.Cleanup(func() {
		a.stop()
		if t.Failed() {
			if data, err := os.ReadFile(filepath.Join(a.dir, "agent.log")); err == nil {
				t.Logf("%s agent log:\n%s", cn.Name, tail(string(data), 40))
			}
		}
	})
	return a
}

func (a *k8sAgent) writeConfig(content string) {
	a.t.Helper()
	path := filepath.Join(a.dir, "config", "ip-masq-agent")
	if err := os.WriteFile(path+".tmp", []byte(content), 0o644); err != nil {
		a.t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		a.t.Fatal(err)
	}
}

func (a *k8sAgent) start() {
	a.t.Helper()
	log, err := os.OpenFile(filepath.Join(a.dir, "agent.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		a.t.Fatal(err)
	}
	defer log.Close()
	a.cmd = exec.Command(agentBin, a.args...)
	a.cmd.Env = append(os.Environ(), a.env...)
	a.cmd.Stdout, a.cmd.Stderr = log, log
	if err := a.cn.Node.Start(a.cmd); err != nil {
		a.t.Fatalf("start agent on %s: %v", a.cn.Name, err)
	}
}

func (a *k8sAgent) stop() {
	if a.cmd == nil || a.cmd.Process == nil {
		return
	}
	a.cmd.Process.Signal(syscall.SIGTERM)
	a.cmd.Wait()
	a.cmd = nil
}

// allocate asks the node's agent for an IPv4 address, retrying while the
// agent starts (no socket yet, or its pools not known yet).
func (a *k8sAgent) allocate(owner string) netip.Addr {
	a.t.Helper()
	c := ipamapi.NewClient(filepath.Join(a.dir, "api.sock"))
	var last error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		r, err := c.Allocate(ctx, ipamapi.AllocationRequest{Owner: owner, Family: "ipv4"})
		cancel()
		if err == nil {
			return r.IP
		}
		last = err
	}
	a.t.Fatalf("%s: allocate %s: %v", a.cn.Name, owner, last)
	return netip.Addr{}
}

// allocateIn allocates for owner until the address is in want: a Node's
// change reaches the agent through its watch, which after an API server
// restart reconnects with client-go's backoff (up to about 30 s). An
// address from the old pool is released again.
func (a *k8sAgent) allocateIn(owner string, want netip.Prefix) netip.Addr {
	a.t.Helper()
	c := ipamapi.NewClient(filepath.Join(a.dir, "api.sock"))
	var got netip.Addr
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		got = a.allocate(owner)
		if want.Contains(got) {
			a.t.Logf("%s allocated %s from its Node's new podCIDRs %s", a.cn.Name, got, want)
			return got
		}
		if err := c.Release(context.Background(), got); err != nil {
			a.t.Fatalf("%s: release %s: %v", a.cn.Name, got, err)
		}
	}
	a.t.Fatalf("%s: allocated %s, want an address of %s (the Node's podCIDRs)", a.cn.Name, got, want)
	return netip.Addr{}
}

// seenFrom opens a TCP flow from n (from the address local, when valid)
// to a ServeSource server and returns the source the server saw.
func seenFrom(n *topology.Netns, local netip.Addr, dst netip.AddrPort) (string, error) {
	var c net.Conn
	err := n.Do(func() (err error) {
		d := net.Dialer{Timeout: 3 * time.Second}
		if local.IsValid() {
			d.LocalAddr = &net.TCPAddr{IP: local.AsSlice()}
		}
		c, err = d.Dial("tcp", dst.String())
		return err
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 64)
	k, err := c.Read(buf)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(buf[:k])), nil
}

const sourcePort = 7070

// expectSource checks, retrying briefly (a change in the tables reaches
// the maps within milliseconds), that a flow from n (source local) to dst
// is seen from want.
func expectSource(t *testing.T, what string, n *topology.Netns, local netip.Addr, dst netip.Addr, want netip.Addr) {
	t.Helper()
	var seen string
	var err error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		seen, err = seenFrom(n, local, netip.AddrPortFrom(dst, sourcePort))
		if err == nil && seen == want.String() {
			t.Logf("%s: %s saw %s", what, dst, seen)
			return
		}
	}
	t.Fatalf("%s: %s saw %q (%v), want %s", what, dst, seen, err, want)
}

func serveSource(t *testing.T, n *topology.Netns) {
	t.Helper()
	l, err := topology.ServeSource(n, sourcePort)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

// setPodCIDRs gives a Node new podCIDRs. The API server allows setting
// them only once, so the Node is deleted and created again, as when a node
// is removed and rejoins the cluster.
func setPodCIDRs(t *testing.T, c kubernetes.Interface, node string, cidr string) {
	t.Helper()
	ctx := context.Background()
	if err := c.CoreV1().Nodes().Delete(ctx, node, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete Node %s: %v", node, err)
	}
	createNode(t, c, node, cidr)
}

func createNode(t *testing.T, c kubernetes.Interface, node string, cidr string) {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}, Spec: corev1.NodeSpec{PodCIDR: cidr, PodCIDRs: []string{cidr}}}
	if _, err := c.CoreV1().Nodes().Create(context.Background(), n, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Node %s: %v", node, err)
	}
}

// TestKubernetesCluster is the multi-node case: one real API
// server, three nodes each running the agent with the DaemonSet's flags and
// RBAC (a token bound to the ClusterRole in deploy/rbac.yaml, nothing
// else), Node objects with different podCIDRs. A fourth node masquerades
// with iptables (the ip-masq-agent's rule) as the reference the agents
// must match.
func TestKubernetesCluster(t *testing.T) {
	server, cl, admin := agentCluster(t, 4)
	for _, cn := range cl.Nodes {
		createNode(t, admin, cn.Name, cn.PodCIDR4.String())
	}
	kubeconfig := agentKubeconfig(t, server, cl)

	// The reference: node4 runs no agent but the Kubernetes ip-masq-agent's
	// rule, for its pod CIDR and the same non-masquerade range.
	ref := cl.Nodes[3]
	refPod := ref.PodCIDR4.Addr().Next().Next()
	if err := cl.AddPodAddr(ref, refPod); err != nil {
		t.Fatal(err)
	}
	ipt := exec.Command("iptables", "-t", "nat", "-A", "POSTROUTING", "-s", ref.PodCIDR4.String(),
		"!", "-d", "10.244.0.0/16", "-o", "eth0", "-j", "MASQUERADE")
	if out, err := startAndWait(ref.Node, ipt); err != nil {
		t.Fatalf("iptables (the reference) in %s: %v: %s", ref.Name, err, out)
	}
	serveSource(t, ref.Pod)

	ds := loadDaemonSet(t)
	// The masquerade sources follow the Node's pod CIDRs (below: a changed
	// range, the old one no longer a source) only when restricted to them;
	// by default every source is masqueraded (TestPodOutsideEveryCIDRMasqueraded).
	ds.args = append(ds.args, "--masquerade-pod-cidrs-only")
	agents := make([]*k8sAgent, 3)
	pods := make([]netip.Addr, 3)
	for i, cn := range cl.Nodes[:3] {
		agents[i] = newK8sAgent(t, ds, cn, kubeconfig)
		agents[i].start()
	}
	// Each agent allocates from its own Node's pool, never the gateway.
	for i, cn := range cl.Nodes[:3] {
		pods[i] = agents[i].allocate("pod/" + cn.Name)
		if want := cn.PodCIDR4.Addr().Next().Next(); pods[i] != want {
			t.Fatalf("%s allocated %s, want %s (the first address of its Node's %s after the gateway)", cn.Name, pods[i], want, cn.PodCIDR4)
		}
		t.Logf("%s (Node podCIDRs %s) allocated %s", cn.Name, cn.PodCIDR4, pods[i])
		if err := cl.AddPodAddr(cn, pods[i]); err != nil {
			t.Fatal(err)
		}
		serveSource(t, cn.Pod)
	}

	// Reference first: if iptables does not give these results, the
	// topology is wrong and the agents' results would prove nothing.
	expectSource(t, "reference: pod4 → external", ref.Pod, netip.Addr{}, topology.ClusterRemoteIP4, ref.IP4)
	expectSource(t, "reference: pod4 → pod1", ref.Pod, netip.Addr{}, pods[0], refPod)

	for i, cn := range cl.Nodes[:3] {
		expectSource(t, cn.Name+": pod → external", cn.Pod, netip.Addr{}, topology.ClusterRemoteIP4, cn.IP4)
		other := pods[(i+1)%3]
		expectSource(t, cn.Name+": pod → pod on another node", cn.Pod, netip.Addr{}, other, pods[i])
		expectSource(t, cn.Name+": pod → reference pod", cn.Pod, netip.Addr{}, refPod, pods[i])
	}

	// node3's podCIDRs change: the agent allocates from the new range and
	// masquerades it; the old range is no longer a masquerade source.
	n3 := cl.Nodes[2]
	setPodCIDRs(t, admin, n3.Name, "10.244.33.0/24")
	if got := agents[2].allocateIn("pod/after-change", netip.MustParsePrefix("10.244.33.0/24")); got != netip.MustParseAddr("10.244.33.2") {
		t.Fatalf("node3 allocated %s after its podCIDRs became 10.244.33.0/24, want 10.244.33.2", got)
	} else {
		if err := n3.Node.Addr("pod0", "10.244.33.1/24"); err != nil {
			t.Fatal(err)
		}
		if err := n3.Pod.Addr("eth0", got.String()+"/24"); err != nil {
			t.Fatal(err)
		}
		expectSource(t, "node3: new pod CIDR → external", n3.Pod, got, topology.ClusterRemoteIP4, n3.IP4)
	}
	expectSource(t, "node3: old pod CIDR (no longer a source) → external", n3.Pod, pods[2], topology.ClusterRemoteIP4, pods[2])

	// The API server goes away. Agents keep masquerading and allocating
	// from the last known pools; an agent restarted now comes up with its
	// pools from disk.
	server.Kill()
	expectSource(t, "node1 during the outage: pod → external", cl.Nodes[0].Pod, netip.Addr{}, topology.ClusterRemoteIP4, cl.Nodes[0].IP4)
	if got := agents[0].allocate("pod/outage"); !cl.Nodes[0].PodCIDR4.Contains(got) {
		t.Fatalf("node1 allocated %s during the outage, want one of %s", got, cl.Nodes[0].PodCIDR4)
	}
	// A NAT rule left in node2's netfilter (the Kubernetes agent's, for its
	// pods) decides before the programs: the restarted agent finds it and,
	// once the API server is back, says so on the Node.
	leftover := exec.Command("iptables", "-t", "nat", "-A", "POSTROUTING", "-s", cl.Nodes[1].PodCIDR4.String(),
		"-o", "eth0", "-j", "MASQUERADE")
	if out, err := startAndWait(cl.Nodes[1].Node, leftover); err != nil {
		t.Fatalf("iptables in %s: %v: %s", cl.Nodes[1].Name, err, out)
	}
	agents[1].stop()
	agents[1].start()
	if got := agents[1].allocate("pod/restarted-in-outage"); !cl.Nodes[1].PodCIDR4.Contains(got) {
		t.Fatalf("node2, restarted during the outage, allocated %s, want one of %s", got, cl.Nodes[1].PodCIDR4)
	}
	expectSource(t, "node2 restarted during the outage: pod → external", cl.Nodes[1].Pod, netip.Addr{}, topology.ClusterRemoteIP4, cl.Nodes[1].IP4)

	// Back: the agents reconnect and follow changes again.
	server.Restart()
	// Before node2's pod CIDRs change below: the leftover rule names the
	// old ones, and once they are no longer a masquerade source the
	// condition is gone (an agent that had not posted it yet never does).
	waitEvent(t, admin, cl.Nodes[1].Name, nodeevents.ReasonNetfilterFirst, "masquerade from "+cl.Nodes[1].PodCIDR4.String())
	setPodCIDRs(t, admin, cl.Nodes[1].Name, "10.244.22.0/24")
	agents[1].allocateIn("pod/after-reconnect", netip.MustParsePrefix("10.244.22.0/24"))

	// A rejected config file shows as an Event on that Node.
	agents[0].writeConfig("nonMasqueradeCIDRs: [10.244.0.1/16]\n")
	waitEvent(t, admin, cl.Nodes[0].Name, nodeevents.ReasonRejected, "10.244.0.1/16")
	agents[0].writeConfig(clusterConfig)
	waitEvent(t, admin, cl.Nodes[0].Name, nodeevents.ReasonAccepted, "accepted")

	// An unknown key is applied around, and named on that Node with the
	// key likely meant; fixed, the warning is cleared.
	agents[0].writeConfig(clusterConfig + "resyncIntervall: 60s\n")
	waitEvent(t, admin, cl.Nodes[0].Name, nodeevents.ReasonWarnings, `unknown key "resyncIntervall" ignored (did you mean resyncInterval?`)
	agents[0].writeConfig(clusterConfig)
	waitEvent(t, admin, cl.Nodes[0].Name, nodeevents.ReasonWarningsCleared, "no warnings")
}

func waitEvent(t *testing.T, c kubernetes.Interface, node, reason, text string) {
	t.Helper()
	var seen []string
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		evs, err := c.CoreV1().Events(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{
			FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + node + ",reason=" + reason,
		})
		if err != nil {
			continue
		}
		seen = seen[:0]
		for _, e := range evs.Items {
			seen = append(seen, e.Message)
			if strings.Contains(e.Message, text) && e.Source.Component == nodeevents.Component {
				t.Logf("Event on Node %s: %s %s: %s", node, e.Type, e.Reason, e.Message)
				return
			}
		}
	}
	t.Fatalf("no Event %s on Node %s mentioning %q; seen %q", reason, node, text, seen)
}

// startAndWait runs cmd in n and returns its output.
func startAndWait(n *topology.Netns, cmd *exec.Cmd) ([]byte, error) {
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := n.Start(cmd); err != nil {
		return nil, err
	}
	err := cmd.Wait()
	return []byte(out.String()), err
}

// agentCluster starts a real API server and a cluster of n nodes connected
// to it, with deploy/'s ServiceAccount, ClusterRole and binding applied:
// the agents' token has these permissions only. It returns the server, the
// cluster and an admin client.
func agentCluster(t *testing.T, n int) (*kubetest.Server, *topology.Cluster, kubernetes.Interface) {
	t.Helper()
	privtest.Require(t)
	server := kubetest.Start(t)
	cl, err := topology.NewCluster(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	if err := cl.ConnectAPI(server.Netns, kubetest.Addr); err != nil {
		t.Fatal(err)
	}
	admin := server.Client(kubetest.AdminToken)
	kubetest.ApplyFiles(t, admin, "../../deploy/rbac.yaml")
	for _, obj := range kubetest.Decode(t, "../../deploy/daemonset.yaml") {
		if sa, ok := obj.(*corev1.ServiceAccount); ok {
			if err := kubetest.Create(admin, sa, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	return server, cl, admin
}

// agentKubeconfig writes the agents' kubeconfig (their token) and serves
// the source-reporting servers on the cluster's external host.
func agentKubeconfig(t *testing.T, server *kubetest.Server, cl *topology.Cluster) string {
	t.Helper()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	server.WriteKubeconfig(kubeconfig, kubetest.AgentToken)
	serveSource(t, cl.Ext)
	return kubeconfig
}
