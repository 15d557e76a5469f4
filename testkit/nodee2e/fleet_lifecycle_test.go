package nodee2e

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ipmasq/ipmasq/ipamapi"
)

// allocationsOn are the agent's IPAM allocations on n, over its API socket.
func (n *fleetNode) allocationsOn() ([]ipamapi.AllocationResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return ipamapi.NewClient(n.Root("/run/ipmasq/api.sock")).List(ctx)
}

// podsOn names the pods bound to the node.
func (f *fleet) podsOn(node string) []string {
	pods, err := f.admin.CoreV1().Pods(corev1.NamespaceAll).List(context.Background(),
		metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		f.t.Fatal(err)
	}
	var names []string
	for _, p := range pods.Items {
		names = append(names, p.Namespace+"/"+p.Name)
	}
	return names
}

// halt stops a node that has left the cluster: its programs, then what is
// left in its mount namespace and cgroup root (node.stop would delete
// every pod of the cluster through the API).
func (n *fleetNode) halt() {
	n.Stop("kube-proxy")
	n.Stop("kubelet")
	n.Stop("containerd")
	killMountNamespace(n.Pid())
	killCgroups(n.cgroupRoot)
	n.stopped = true
}

// testFleetLifecycle is item 4 of issue 31: with streams running on the
// other nodes, a node joins (the controller manager gives it a pod CIDR,
// the DaemonSet starts the agent there, its pods masquerade) and leaves
// (drained, deleted: the pod GC removes the agent's pod, the node's
// uninstall (the Job's command) leaves nothing of ipmasq on it, and the
// API holds nothing of it).
func testFleetLifecycle(t *testing.T, f *fleet, streams []*fleetStream) {
	step := time.Now()
	n := f.addNode(len(f.nodes) + 1)
	pods := f.agentPodsReady(120 * time.Second)
	t.Logf("%s joined (pod CIDR %s) and its agent %s is Ready in %v", n.name, n.cidr, pods[n.name].Name, time.Since(step).Round(time.Millisecond))
	checkStreams(streams, n.name+" joined")
	pod := fmt.Sprintf("joiner-%d", n.index)
	p := f.runPodOn(n, pod, nil, "dial", masqDial, plainDial)
	ip := mustAddr(t, p.Status.PodIP)
	if !n.cidr.Contains(ip) {
		t.Errorf("pod %s on %s has %s, outside the node's pod CIDR %s", pod, n.name, ip, n.cidr)
	}
	f.eventually(20*time.Second, pod+"'s connections at the external host", func() error {
		if len(f.seen.sources(pod, masqDial)) == 0 || len(f.seen.sources(pod, plainDial)) == 0 {
			return fmt.Errorf("none yet")
		}
		return nil
	})
	for from, c := range f.seen.sources(pod, masqDial) {
		if from != n.ip {
			t.Errorf("%s on the new node: %d connections to %s from %s, want the node's %s", pod, c, masqTarget, from, n.ip)
		}
	}
	for from, c := range f.seen.sources(pod, plainDial) {
		if from != ip {
			t.Errorf("%s on the new node: %d connections to %s from %s, want its own %s", pod, c, plainTarget, from, ip)
		}
	}

	// Leave: drain (cordon, the ordinary pods deleted: their addresses
	// released), then the Node deleted.
	step = time.Now()
	ctx := context.Background()
	patch := []byte(`{"spec":{"unschedulable":true}}`)
	if _, err := f.admin.CoreV1().Nodes().Patch(ctx, n.name, "application/merge-patch+json", patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	f.deletePod(fleetNamespace, pod)
	if allocs, err := n.allocationsOn(); err != nil || len(allocs) != 0 {
		t.Errorf("%s drained: the agent's allocations %v (%v), want none", n.name, allocs, err)
	}
	if err := f.admin.CoreV1().Nodes().Delete(ctx, n.name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// The pod GC deletes the pods of a deleted Node (after its 40 s
	// quarantine), and the kubelet stops their containers.
	f.eventually(150*time.Second, "the pods of the deleted "+n.name+" gone", func() error {
		if left := f.podsOn(n.name); len(left) > 0 {
			return fmt.Errorf("%v", left)
		}
		return nil
	})
	f.eventually(60*time.Second, "the agent's container on "+n.name+" stopped", func() error {
		out, err := n.Run("ctr", "-n", "k8s.io", "tasks", "ls")
		if err != nil {
			return err
		}
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, "RUNNING") {
				if c, _ := n.Run("ctr", "-n", "k8s.io", "containers", "info", strings.Fields(l)[0]); strings.Contains(c, "ipmasq-agent:") {
					return fmt.Errorf("still running: %s", l)
				}
			}
		}
		return nil
	})
	// The node-level uninstall (deploy/uninstall's Job runs this command
	// with these paths; a Job bound to a deleted Node would be deleted by
	// the pod GC): the machine holds nothing of ipmasq afterwards.
	if out, err := n.Run(f.agent, "uninstall", "--bpf-root=/sys/fs/bpf", "--state-dir=/var/lib/ipmasq",
		"--api-socket=/run/ipmasq/api.sock", "--shell-sock-path=/run/ipmasq/shell.sock", "--egress-rule-priority=111"); err != nil {
		t.Fatalf("ipmasq-agent uninstall on %s: %v\n%s", n.name, err, out)
	}
	for _, file := range []string{cniConfigPath, "/opt/cni/bin/ipmasq-cni"} {
		n.MustRun("rm", "-f", file)
	}
	view := &cluster{t: t, node: n.node, nodeNetns: n.ns}
	if left := view.ipmasqOnNode(); len(left) > 0 {
		t.Errorf("%s left, but it still holds:\n%s", n.name, strings.Join(left, "\n"))
	}
	n.halt()
	ds, err := f.admin.AppsV1().DaemonSets("kube-system").Get(ctx, "ipmasq-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	f.eventually(30*time.Second, "the DaemonSet back to the nodes left", func() error {
		ds, err = f.admin.AppsV1().DaemonSets("kube-system").Get(ctx, "ipmasq-agent", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if want := int32(len(f.nodes) - 1); ds.Status.DesiredNumberScheduled != want || ds.Status.NumberReady != want {
			return fmt.Errorf("desired %d, ready %d, want %d", ds.Status.DesiredNumberScheduled, ds.Status.NumberReady, want)
		}
		return nil
	})
	t.Logf("%s left (drained, deleted, uninstalled) in %v", n.name, time.Since(step).Round(time.Millisecond))
	checkStreams(streams, n.name+" left")
}

// testFleetRollout is item 2 of issue 31 (the test): a rolling update the
// agent cannot run stops at the first node (the DaemonSet's
// maxUnavailable: 1): the other nodes keep their Ready agents on the old
// template, and every node keeps masquerading (the stuck node's datapath
// stays attached without its agent). Then the DaemonSet is rolled back.
func testFleetRollout(t *testing.T, f *fleet, streams []*fleetStream) {
	for _, c := range []struct {
		what   string
		change func(*appsv1.DaemonSet)
		bad    func(*corev1.Pod) bool
		// stuck, when set, checks the node the rollout stopped at.
		stuck func(*fleetNode) error
	}{
		{"an image the node does not have", func(ds *appsv1.DaemonSet) {
			setImage(t, ds, "localhost/ipmasq-nodee2e/ipmasq-agent:missing")
		}, func(p *corev1.Pod) bool {
			return p.Spec.Containers[0].Image == "localhost/ipmasq-nodee2e/ipmasq-agent:missing"
		}, nil},
		{"a flag the agent refuses", func(ds *appsv1.DaemonSet) {
			ds.Spec.Template.Spec.Containers[0].Args = append(ds.Spec.Template.Spec.Containers[0].Args, "--egress-rule-priority=0")
		}, func(p *corev1.Pod) bool {
			return slices.Contains(p.Spec.Containers[0].Args, "--egress-rule-priority=0")
		}, nil},
		// An unreadable Node: the namespace's default ServiceAccount, which
		// deploy/rbac.yaml grants nothing (a template edited by hand, or a
		// chart that does not create the agent's account). The agent runs,
		// its datapath attached and its IPAM serving the pods of the node
		// from the pod CIDRs it saved, but it cannot read its Node: it must
		// not be Ready, and say why.
		{"a ServiceAccount that may not read Nodes", func(ds *appsv1.DaemonSet) {
			ds.Spec.Template.Spec.ServiceAccountName = "default"
		}, func(p *corev1.Pod) bool {
			return p.Spec.ServiceAccountName == "default"
		}, func(n *fleetNode) error {
			code, body, err := f.agentGet(n, "/readyz")
			if err != nil {
				return err
			}
			if code != http.StatusServiceUnavailable || !strings.Contains(body, "node: cannot read the agent's Node") || !strings.Contains(body, "forbidden") {
				return fmt.Errorf("the agent's /readyz answers %d:\n%s\nwant 503 with the node condition, forbidden", code, body)
			}
			// The IPAM is in use: the agent answers on its socket with the
			// node's pods' addresses.
			allocs, err := n.allocationsOn()
			if err != nil {
				return fmt.Errorf("the agent's API: %w", err)
			}
			if len(allocs) == 0 {
				return fmt.Errorf("the agent's API lists no allocation, want the node's pods'")
			}
			return nil
		}},
	} {
		step := time.Now()
		f.rolloutStuck(c.what, c.change, c.bad, c.stuck)
		checkStreams(streams, "a rollout with "+c.what)
		t.Logf("rollout with %s stopped at one node, rolled back, in %v", c.what, time.Since(step).Round(time.Millisecond))
	}
}

// rolloutStuck updates the DaemonSet with change and checks, over 30 s
// after the first node's pod is bad, that the rollout goes no further, and
// then stuck (when not nil) on the node of the bad pod; then restores the
// template and waits for every agent to be Ready.
func (f *fleet) rolloutStuck(what string, change func(*appsv1.DaemonSet), bad func(*corev1.Pod) bool, stuck func(*fleetNode) error) {
	t := f.t
	ctx := context.Background()
	dss := f.admin.AppsV1().DaemonSets("kube-system")
	var good *corev1.PodTemplateSpec
	// Get and update again on a conflict (the controller writes the
	// DaemonSet's status).
	update := func(what string, edit func(*appsv1.DaemonSet)) {
		f.eventually(30*time.Second, what, func() error {
			ds, err := dss.Get(ctx, "ipmasq-agent", metav1.GetOptions{})
			if err != nil {
				return err
			}
			edit(ds)
			_, err = dss.Update(ctx, ds, metav1.UpdateOptions{})
			return err
		})
	}
	update("the DaemonSet updated with "+what, func(ds *appsv1.DaemonSet) {
		good = ds.Spec.Template.DeepCopy()
		change(ds)
	})
	// badNode is the node of the last bad pod agents saw.
	var badNode string
	agents := func() (badPods, goodReady int, err error) {
		pods, err := f.admin.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ipmasq-agent"})
		if err != nil {
			return 0, 0, err
		}
		for i := range pods.Items {
			p := &pods.Items[i]
			switch {
			case bad(p):
				badPods++
				badNode = p.Spec.NodeName
				if podReady(p) {
					return 0, 0, fmt.Errorf("the agent with %s is Ready: %s", what, p.Name)
				}
			case podReady(p) && p.DeletionTimestamp == nil:
				goodReady++
			}
		}
		return badPods, goodReady, nil
	}
	running := 0
	for _, n := range f.nodes {
		if !n.stopped {
			running++
		}
	}
	f.eventually(60*time.Second, "the first node's agent replaced with "+what, func() error {
		b, _, err := agents()
		if err != nil {
			t.Fatal(err)
		}
		if b == 0 {
			return fmt.Errorf("no pod with %s yet", what)
		}
		return nil
	})
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(time.Second) {
		b, g, err := agents()
		if err != nil {
			t.Fatal(err)
		}
		if b != 1 || g != running-1 {
			t.Fatalf("rollout with %s: %d bad agent pods, %d good Ready ones; want it stopped at one node (maxUnavailable 1): 1 and %d", what, b, g, running-1)
		}
	}
	if stuck != nil {
		i := slices.IndexFunc(f.nodes, func(n *fleetNode) bool { return n.name == badNode })
		if i < 0 {
			t.Fatalf("rollout with %s: the bad pod is on %q, not a node of the fleet", what, badNode)
		}
		f.eventually(30*time.Second, "rollout with "+what+": the agent on "+badNode, func() error { return stuck(f.nodes[i]) })
	}
	update("the DaemonSet rolled back", func(ds *appsv1.DaemonSet) { ds.Spec.Template = *good })
	f.eventually(120*time.Second, "every agent back on the good template", func() error {
		b, g, err := agents()
		if err != nil {
			return err
		}
		if b != 0 || g != running {
			return fmt.Errorf("%d bad, %d good Ready of %d", b, g, running)
		}
		return nil
	})
}

// testFleetSocketDirRemoved is item 6 of issue 31: the API socket's
// directory removed on a node while its agent runs (`rm -rf /run/ipmasq`,
// a cleanup of another process). The agent's hostPath mount still shows it
// the removed directory, so binding its socket again there would reach
// nobody: the agent stops with that error, the kubelet restarts it, the
// runtime makes the host's directory again for the new container, and the
// CNI plugin's socket is back with the node's allocations; the node keeps
// masquerading meanwhile.
func testFleetSocketDirRemoved(t *testing.T, f *fleet, streams []*fleetStream) {
	n := f.nodes[0]
	before := f.agentPodsReady(30 * time.Second)[n.name]
	restarts := before.Status.ContainerStatuses[0].RestartCount
	allocs, err := n.allocationsOn()
	if err != nil {
		t.Fatalf("%s's agent API before: %v", n.name, err)
	}
	step := time.Now()
	n.MustRun("rm", "-rf", "/run/ipmasq")
	f.eventually(120*time.Second, "the agent on "+n.name+" restarted and its API socket back", func() error {
		p, err := f.admin.CoreV1().Pods("kube-system").Get(context.Background(), before.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if got := p.Status.ContainerStatuses[0].RestartCount; got <= restarts || !podReady(p) {
			return fmt.Errorf("pod %s: %d restarts (%d before), ready %v", p.Name, got, restarts, podReady(p))
		}
		after, err := n.allocationsOn()
		if err != nil {
			return err
		}
		if len(after) != len(allocs) {
			return fmt.Errorf("%d allocations, %d before", len(after), len(allocs))
		}
		return nil
	})
	t.Logf("/run/ipmasq removed on %s: the agent restarted and its API socket answers again in %v", n.name, time.Since(step).Round(time.Millisecond))
	checkStreams(streams, "/run/ipmasq removed on "+n.name)
}
