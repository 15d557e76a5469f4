package e2e

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// podCIDRsOnlyConfig is ipmasq's file for the --masquerade-pod-cidrs-only
// tests, and podCIDRsOnlyNonMasq the same ranges as the reference's
// "! -d": the cluster's pod ranges are not masqueraded.
const podCIDRsOnlyConfig = "nonMasqueradeCIDRs: [10.244.0.0/16, fd00::/8]\nmasqLinkLocal: false\n"

var podCIDRsOnlyNonMasq = map[bool]string{false: "10.244.0.0/16", true: "fd00::/8"}

// notReadyFor is how long a not-ready agent is watched: the condition must
// hold all along, not only while the agent starts.
const notReadyFor = 5 * time.Second

// TestPodCIDRsOnlyNotReadyWithoutPodCIDR: with --masquerade-pod-cidrs-only
// and no pod CIDR known (no --pod-cidr, --cluster-cidr or Node), nothing is
// masqueraded, so the agent is not Ready: /readyz is not 200 for as long
// as it runs so, and /readyz, /healthz and `status` say why (a migration
// waiting on readiness keeps the old chain). Restarted with --pod-cidr, as
// an operator fixes it, it is Ready and the pod's connections reach the
// far side from the node's address, as under the reference: Linux
// MASQUERADE for the pod CIDRs except the cluster's range
// (-s <pod CIDR> ! -d <non-masquerade> -j MASQUERADE) on the same
// topology, where ext has a route back to the pods (an unmasqueraded flow
// is answered, and seen from the pod's address).
func TestPodCIDRsOnlyNotReadyWithoutPodCIDR(t *testing.T) {
	referenceFailed := false
	reference := masquerader{name: "MASQUERADE", start: func(t *testing.T, topo *topology.Masquerade) {
		if err := topo.RouteBack(); err != nil {
			t.Fatal(err)
		}
		for _, src := range podSources {
			v6 := netip.MustParsePrefix(src).Addr().Is6()
			if err := topo.Node.Iptables(v6, "-t", "nat", "-A", "POSTROUTING", "-s", src, "!", "-d", podCIDRsOnlyNonMasq[v6], "-j", "MASQUERADE"); err != nil {
				t.Fatal(err)
			}
		}
	}}
	var a *agent
	ipmasq := masquerader{name: "ipmasq", start: func(t *testing.T, topo *topology.Masquerade) {
		if referenceFailed {
			t.Fatal("the reference (Linux MASQUERADE) failed on this topology: the scenario proves nothing")
		}
		if err := topo.RouteBack(); err != nil {
			t.Fatal(err)
		}
		a = newAgent(t, topo.Node, podCIDRsOnlyConfig)
		a.noPodCIDR = true
		a.args = []string{"--masquerade-pod-cidrs-only", "--prometheus-serve-addr=" + metricsAddr}
		// The programs are attached (the datapath is up): only the
		// missing source keeps it from being ready.
		a.start()
	}}
	runEach(t, []masquerader{reference, ipmasq}, func(t *testing.T, topo *topology.Masquerade) {
		if a == nil {
			t.Cleanup(func() { referenceFailed = t.Failed() })
		}
		startServers(t, topo.Ext, topology.RemoteIP4, topology.RemoteIP6)
		if a != nil {
			expectNotReadyWithoutSource(t, topo.Node, filepath.Join(a.dir, "shell.sock"))
			// Not ready for a reason: the pod's connections leave
			// unmasqueraded (ext routes them back).
			for _, c := range []struct{ dst, pod netip.Addr }{{topology.RemoteIP4, topology.PodIP4}, {topology.RemoteIP6, topology.PodIP6}} {
				if seen, err := tcpSource(topo.Pod, c.dst); err != nil || seen != c.pod.String() {
					t.Errorf("TCP from the pod to %s with no source: seen from %q (%v), want the pod's own %s", c.dst, seen, err, c.pod)
				}
			}

			// The operator's fix: the pod CIDRs on the command line.
			a.stop(syscall.SIGTERM)
			a.noPodCIDR = false
			a.start()
			a.waitReady()
			if status := statusOnceUp(t, filepath.Join(a.dir, "shell.sock")); !strings.Contains(status, "Readiness:  ready\n") {
				t.Errorf("with --pod-cidr, status does not say ready:\n%s", status)
			}
		}

		leaks := watchLeaks(t, topo.Ext, "eth0", podSources...)
		for _, c := range []struct {
			dst, want netip.Addr
		}{{topology.RemoteIP4, topology.NodeIP4}, {topology.RemoteIP6, topology.NodeIP6}} {
			if seen, err := tcpSource(topo.Pod, c.dst); err != nil || seen != c.want.String() {
				t.Errorf("TCP from the pod to %s: seen from %q (%v), want the node's %s", c.dst, seen, err, c.want)
			}
			if seen, err := udpSource(topo.Pod, c.dst); err != nil || seen != c.want.String() {
				t.Errorf("UDP from the pod to %s: seen from %q (%v), want the node's %s", c.dst, seen, err, c.want)
			}
		}
		leaks.check(t)
	})
}

// expectNotReadyWithoutSource checks, for notReadyFor, that the agent in
// node (serving on metricsAddr, with --masquerade-pod-cidrs-only and no
// pod CIDR) is not ready, and that /readyz, /healthz and `ipmasq-agent
// status` (asked at shellSock) say why.
func expectNotReadyWithoutSource(t *testing.T, node *topology.Netns, shellSock string) {
	t.Helper()
	const why = "sources: no source is masqueraded: --masquerade-pod-cidrs-only and no pod CIDR is known"
	// While the agent starts, other conditions hold too (programs not
	// attached yet, Node not read yet): wait until the missing source is
	// the one reason left.
	var code int
	var body string
	var err error
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		code, body, err = httpGet(node, metricsAddr, "/readyz")
		if err == nil && code == http.StatusServiceUnavailable && strings.HasPrefix(body, "not ready: 1 conditions\n"+why) {
			break
		}
		if err == nil && code == http.StatusOK {
			t.Fatalf("/readyz with --masquerade-pod-cidrs-only and no pod CIDR: %d %q, want not 200 naming %q", code, body, why)
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz never named the missing source as the one reason in 30 s: %d %q (%v)", code, body, err)
		}
	}
	checks := 0
	for start := time.Now(); time.Since(start) < notReadyFor; time.Sleep(100 * time.Millisecond) {
		c, b, err := httpGet(node, metricsAddr, "/readyz")
		if err != nil {
			t.Fatalf("/readyz after %v: %v", time.Since(start).Round(time.Millisecond), err)
		}
		if c == http.StatusOK || !strings.Contains(b, why) {
			t.Fatalf("/readyz after %v with --masquerade-pod-cidrs-only and no pod CIDR: %d %q, want not 200 naming %q",
				time.Since(start).Round(time.Millisecond), c, b, why)
		}
		code, body = c, b
		checks++
	}
	t.Logf("/readyz not ready for %v (%d checks): %d %q", notReadyFor, checks, code, body)

	if c, b, err := httpGet(node, metricsAddr, "/healthz"); err != nil || c != http.StatusServiceUnavailable || !strings.Contains(b, "readiness") {
		t.Errorf("/healthz with no source: %d %q (%v), want 503 naming the degraded scope readiness", c, b, err)
	} else {
		t.Logf("/healthz: %d %q", c, b)
	}
	st := statusOnceUp(t, shellSock)
	if !strings.Contains(st, "Readiness:  NOT READY: ") || !strings.Contains(st, why) {
		t.Errorf("status with no source does not say NOT READY and why (%q):\n%s", why, st)
	}
	if strings.Contains(st, "remove the old chain") {
		t.Errorf("status tells to remove the old chain on a node that is not ready:\n%s", st)
	}
}

// TestPodCIDRsOnlyReadyWhenNodeGetsPodCIDRs is the same case on a
// Kubernetes node: the agent runs as the DaemonSet runs it, with
// --masquerade-pod-cidrs-only added, against a real API server, and its
// Node has no spec.podCIDRs yet (a node the node IPAM controller has not
// given a range to, or a CNI that allocates without them). The agent is
// not ready while nothing is masqueraded (the pod's connection reaches the
// far side from the pod's own address); once the Node gets its podCIDRs it
// becomes ready without a restart, and the pod's connection is seen from
// the node's address, as on the reference node: Linux MASQUERADE
// (-s <pod CIDR> ! -d 10.244.0.0/16, the ip-masq-agent's rule) on another
// node of the same cluster.
func TestPodCIDRsOnlyReadyWhenNodeGetsPodCIDRs(t *testing.T) {
	server, cl, admin := agentCluster(t, 2)
	kubeconfig := agentKubeconfig(t, server, cl)

	// node1's pod: with no pool, the IPAM allocates nothing, so its
	// address is set by hand, where its Node's range will be.
	cn := cl.Nodes[0]
	pod := cn.PodCIDR4.Addr().Next().Next()
	if err := cl.AddPodAddr(cn, pod); err != nil {
		t.Fatal(err)
	}
	serveSource(t, cn.Pod)

	// Reference first: node2 masquerades its pod with iptables, except
	// to the cluster's pod range.
	ref := cl.Nodes[1]
	refPod := ref.PodCIDR4.Addr().Next().Next()
	if err := cl.AddPodAddr(ref, refPod); err != nil {
		t.Fatal(err)
	}
	serveSource(t, ref.Pod)
	ipt := exec.Command("iptables", "-t", "nat", "-A", "POSTROUTING", "-s", ref.PodCIDR4.String(),
		"!", "-d", "10.244.0.0/16", "-j", "MASQUERADE")
	if out, err := startAndWait(ref.Node, ipt); err != nil {
		t.Fatalf("iptables (the reference) in %s: %v: %s", ref.Name, err, out)
	}
	expectSource(t, "reference: pod2 → external", ref.Pod, netip.Addr{}, topology.ClusterRemoteIP4, ref.IP4)
	expectSource(t, "reference: pod2 → pod1", ref.Pod, netip.Addr{}, pod, refPod)

	// node1's Node has no podCIDRs.
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: cn.Name}}
	if _, err := admin.CoreV1().Nodes().Create(context.Background(), n, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Node %s: %v", cn.Name, err)
	}
	ds := loadDaemonSet(t)
	if !slices.Contains(ds.args, "--prometheus-serve-addr=:9464") {
		t.Fatalf("deploy/daemonset.yaml no longer serves /readyz on :9464 (the address this test asks): %q", ds.args)
	}
	ds.args = append(ds.args, "--masquerade-pod-cidrs-only")
	a := newK8sAgent(t, ds, cn, kubeconfig)
	a.start()
	expectNotReadyWithoutSource(t, cn.Node, filepath.Join(a.dir, "shell.sock"))
	expectSource(t, "node1 with no pod CIDR: pod → external", cn.Pod, netip.Addr{}, topology.ClusterRemoteIP4, pod)

	// The Node gets its range (an empty podCIDRs may be set once).
	got, err := admin.CoreV1().Nodes().Get(context.Background(), cn.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got.Spec.PodCIDR, got.Spec.PodCIDRs = cn.PodCIDR4.String(), []string{cn.PodCIDR4.String()}
	if _, err := admin.CoreV1().Nodes().Update(context.Background(), got, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("give Node %s podCIDRs %s: %v", cn.Name, cn.PodCIDR4, err)
	}
	waitReadyIn(t, cn.Node, 30*time.Second)
	if st := statusOnceUp(t, filepath.Join(a.dir, "shell.sock")); !strings.Contains(st, "Readiness:  ready\n") {
		t.Errorf("with the Node's podCIDRs, status does not say ready:\n%s", st)
	}
	expectSource(t, "node1 with its Node's podCIDRs: pod → external", cn.Pod, netip.Addr{}, topology.ClusterRemoteIP4, cn.IP4)
	expectSource(t, "node1 with its Node's podCIDRs: pod → pod2 (not masqueraded)", cn.Pod, netip.Addr{}, refPod, pod)
}

// statusOnceUp is `ipmasq-agent status` asked at sock, retried while the
// agent's shell is not listening yet: its start hook runs after every
// other (the datapath's, which loads the programs, can take seconds on a
// loaded machine), while /readyz is served early.
func statusOnceUp(t *testing.T, sock string) string {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		out, err := exec.Command(agentBin, "status", "--shell-sock-path="+sock).CombinedOutput()
		if err == nil {
			return string(out)
		}
		if !strings.Contains(string(out), "no agent shell at") || time.Now().After(deadline) {
			t.Fatalf("status: %v\n%s", err, out)
		}
	}
}

// waitReadyIn waits until /readyz at metricsAddr in node answers 200.
func waitReadyIn(t *testing.T, node *topology.Netns, timeout time.Duration) {
	t.Helper()
	var last string
	start := time.Now()
	for deadline := start.Add(timeout); ; time.Sleep(50 * time.Millisecond) {
		code, body, err := httpGet(node, metricsAddr, "/readyz")
		if err == nil && code == http.StatusOK {
			t.Logf("/readyz after %v: %d %q", time.Since(start).Round(time.Millisecond), code, body)
			return
		}
		last = fmt.Sprintf("%d %q (%v)", code, body, err)
		if time.Now().After(deadline) {
			t.Fatalf("/readyz never answered 200 in %v; last: %s", timeout, last)
		}
	}
}
