package nodee2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// The external host's addresses: masqTarget is outside every
// non-masquerade CIDR of deploy/configmap.yaml, plainTarget inside
// 10.0.0.0/8 (pods keep their address towards it).
const (
	masqTarget   = "203.0.113.10"
	plainTarget  = "10.50.0.10"
	dialPort     = 8000 // podprog dial connects here, to both targets
	streamPort   = 8001 // podprog stream connects here, to masqTarget
	routeTable   = "11"
	agentImageV1 = "localhost/ipmasq-nodee2e/ipmasq-agent:1"
	agentImageV2 = "localhost/ipmasq-nodee2e/ipmasq-agent:2"
	// cniConfigPath is where the host step puts deploy/cni's file.
	cniConfigPath = "/etc/cni/net.d/90-ipmasq.conflist"
)

// The external host's services as pods name them.
var (
	masqDial   = netip.AddrPortFrom(netip.MustParseAddr(masqTarget), dialPort).String()
	plainDial  = netip.AddrPortFrom(netip.MustParseAddr(plainTarget), dialPort).String()
	masqStream = netip.AddrPortFrom(netip.MustParseAddr(masqTarget), streamPort).String()
)

// cluster is the API server, scheduler and controller manager, one node
// and the external host.
type cluster struct {
	t         *testing.T
	api       *kubetest.Server
	admin     kubernetes.Interface
	node      *node
	ext       *topology.Netns
	seen      *external
	dir       string
	ctl       map[string]*exec.Cmd
	nodeNetns *topology.Netns
	// ipmasqCNI: the pods' network is ipmasq-cni's (installCNI), so the
	// agent's IPAM API must answer.
	ipmasqCNI bool
}

// startCluster brings everything up to a Ready node with ipmasq's CNI
// installed (and the routing of a routed node, nodeNetwork), and the
// images of the test imported, the agent's as agentImageV1; the agent is
// not deployed yet.
func startCluster(t *testing.T) *cluster {
	t.Helper()
	return startClusterWith(t, agentImageV1, func(c *cluster) {
		c.nodeNetwork()
		c.installCNI()
	})
}

// startClusterWith is startCluster with the agent's image built by `make
// image IMAGE=agentImage` (empty: plain `make image`, the reference deploy/
// names) and the pods' network installed by installCNI (the host step,
// before containerd starts).
func startClusterWith(t *testing.T, agentImage string, installCNI func(*cluster)) *cluster {
	t.Helper()
	privtest.Require(t)
	for _, tool := range []string{"containerd", "ctr", "runc", "nsenter", "unshare", "iptables", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found (%v): the real-node test needs the Debian packages containerd, runc, iptables, iproute2 and util-linux (.ci/run installs them)", tool, err)
		}
	}
	checkHostUnchanged(t)
	c := &cluster{t: t, dir: t.TempDir(), seen: newExternal(), ctl: map[string]*exec.Cmd{}}

	begin := time.Now()
	bins, err := kubetest.NodeBinariesBuilt()
	if err != nil {
		t.Fatalf("kubelet, kube-scheduler, kube-controller-manager: %v", err)
	}
	images := c.buildImages(agentImage)
	t.Logf("binaries and images ready in %v", time.Since(begin).Round(time.Millisecond))

	begin = time.Now()
	c.api = kubetest.Start(t)
	c.admin = c.api.Client(kubetest.AdminToken)
	c.network()
	c.startControlPlane(bins)
	nodeNS := c.nodeNetns
	c.node = startNode(t, nodeNS)
	t.Cleanup(func() {
		if t.Failed() {
			c.logs()
		}
		c.node.stop(c.admin)
	})
	installCNI(c)
	c.node.startContainerd(images...)
	c.node.startKubelet(c.api, bins.Kubelet)
	c.waitNodeReady()
	c.serviceProxy()
	t.Logf("node Ready in %v", time.Since(begin).Round(time.Millisecond))
	return c
}

// logs shows the end of the node's and the control plane's logs, and the
// agent's containers' (before the teardown deletes them).
func (c *cluster) logs() {
	t := c.t
	for _, p := range []string{"kubelet", "containerd"} {
		t.Logf("%s errors:\n%s", p, c.node.LogErrors(p, 25))
	}
	logs, _ := filepath.Glob(c.node.Root("/var/log/pods/kube-system_ipmasq-*/*/*.log"))
	for _, l := range logs {
		t.Logf("%s:\n%s", l, tail(l, 30))
	}
	for _, p := range []string{"kube-scheduler", "kube-controller-manager"} {
		t.Logf("%s log:\n%s", p, tail(filepath.Join(c.dir, p+".log"), 20))
	}
}

// buildImages builds the pause and pod images as docker archives, and the
// agent's with `make image` (as an operator does; IMAGE=agentImage unless
// empty). Empty, the image gets the reference deploy/image/kustomization.yaml
// names, given as IMAGE: plain `make image` would set that file's newTag
// to the checkout's version, editing the tree under test.
func (c *cluster) buildImages(agentImage string) []string {
	if agentImage == "" {
		agentImage = defaultImage(c.t)
	}
	bin := filepath.Join(c.dir, "bin")
	prog := goBuild(c.t, bin, "github.com/ipmasq/ipmasq/testkit/nodee2e/podprog")
	pause, pod, agent := filepath.Join(c.dir, "pause.tar"), filepath.Join(c.dir, "pod.tar"), filepath.Join(c.dir, "agent.tar")
	writeImage(c.t, pause, pauseImage, prog, "podprog", "pause")
	writeImage(c.t, pod, podImage, prog, "podprog")
	make := exec.Command("make", "-C", "../..", "image", "IMAGE="+agentImage, "IMAGE_TAR="+agent, "BIN="+bin)
	if out, err := make.CombinedOutput(); err != nil {
		c.t.Fatalf("make image: %v\n%s", err, out)
	}
	return []string{pause, pod, agent}
}

// network: the node's and the external host's namespaces, the node
// connected to both the external host (eth0) and the API server (api0).
func (c *cluster) network() {
	t := c.t
	var err error
	if c.nodeNetns, err = topology.NewNetns("node"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.nodeNetns.Close)
	if c.ext, err = topology.NewNetns("ext"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.ext.Close)
	api := c.api.Netns
	for _, step := range []func() error{
		func() error { return topology.Veth(c.nodeNetns, "eth0", c.ext, "eth0", 0) },
		func() error { return topology.Veth(c.nodeNetns, "api0", api, "node0", 0) },
		func() error { return c.nodeNetns.Addr("eth0", nodeIP+"/24") },
		func() error { return c.ext.Addr("eth0", extIP+"/24") },
		func() error { return c.ext.Addr("lo", masqTarget+"/32") },
		func() error { return c.ext.Addr("lo", plainTarget+"/32") },
		// The pods' own addresses come back through the node (traffic to
		// a non-masquerade CIDR keeps them).
		func() error { return c.ext.Route(clusterCIDR, nodeIP, "eth0") },
		func() error { return c.nodeNetns.Addr("api0", nodeAPIIP+"/30") },
		func() error { return api.Addr("node0", apiPeerIP+"/30") },
		func() error { return c.nodeNetns.Route(kubetest.Addr.String()+"/32", apiPeerIP, "api0") },
		// The agent's connections to the kubernetes Service leave with
		// the source of the default route (serviceProxy), so the API
		// server needs the way back to the node's address too.
		func() error { return api.Route(nodeIP+"/32", nodeAPIIP, "node0") },
		func() error { return c.nodeNetns.Route("default", extIP, "eth0") },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	c.seen.serveDial(t, c.ext, dialPort)
	c.seen.serveStream(t, c.ext, streamPort)
}

// nodeNetwork adds the routing a routed (ENI-like) node has: the
// non-masquerade destination plainTarget is reachable only through route
// table 11, which the pods' per-endpoint ip rules select; the main table
// refuses it.
func (c *cluster) nodeNetwork() {
	c.node.MustRun("ip", "route", "add", "unreachable", plainTarget+"/32")
	c.node.MustRun("ip", "route", "add", plainTarget+"/32", "via", extIP, "dev", "eth0", "table", routeTable)
}

// startControlPlane runs kube-scheduler and kube-controller-manager next to
// the API server. The controller manager allocates the Node's pod CIDR
// (--allocate-node-cidrs) and runs the controllers a DaemonSet and pods
// need: nodelifecycle takes the not-ready taint the kubelet registers the
// Node with off once it is Ready, the garbage collector deletes a deleted
// DaemonSet's pods, job runs the uninstall Job.
func (c *cluster) startControlPlane(bins kubetest.NodeBinaries) {
	kubeconfig := filepath.Join(c.dir, "admin.kubeconfig")
	c.api.WriteKubeconfig(kubeconfig, kubetest.AdminToken)
	c.startControl("kube-scheduler", bins.Scheduler, "--kubeconfig="+kubeconfig, "--leader-elect=false", "--secure-port=0")
	c.startControl("kube-controller-manager", bins.ControllerManager, "--kubeconfig="+kubeconfig,
		"--leader-elect=false", "--secure-port=0",
		"--controllers=daemonset,serviceaccount,root-ca-cert-publisher,nodeipam,nodelifecycle,garbagecollector,job",
		"--allocate-node-cidrs", "--cluster-cidr="+clusterCIDR, "--node-cidr-mask-size=24",
		"--service-cluster-ip-range=10.96.0.0/16", "--root-ca-file="+c.api.CertFile)
}

func (c *cluster) startControl(name, bin string, args ...string) {
	c.t.Helper()
	log, err := os.Create(filepath.Join(c.dir, name+".log"))
	if err != nil {
		c.t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := c.api.Netns.Start(cmd); err != nil {
		c.t.Fatalf("start %s: %v", name, err)
	}
	c.ctl[name] = cmd
	c.t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
}

// installCNI is the host step of docs/deploy.md: ipmasq-cni and the
// upstream ptp (and loopback, which the runtime runs for every pod) in
// /opt/cni/bin, deploy/cni/90-ipmasq.conflist in /etc/cni/net.d with
// routeTable set, as a routed node's operator does.
func (c *cluster) installCNI() {
	c.ipmasqCNI = true
	t := c.t
	bin := filepath.Join(c.dir, "cni")
	for _, pkg := range []string{
		"github.com/ipmasq/ipmasq/cmd/ipmasq-cni",
		"github.com/containernetworking/plugins/plugins/main/ptp",
		"github.com/containernetworking/plugins/plugins/main/loopback",
	} {
		b := goBuild(t, bin, pkg)
		data, err := os.ReadFile(b)
		if err != nil {
			t.Fatal(err)
		}
		c.node.WriteFile("/opt/cni/bin/"+filepath.Base(b), data, 0o755)
	}
	shipped, err := os.ReadFile("../../deploy/cni/90-ipmasq.conflist")
	if err != nil {
		t.Fatal(err)
	}
	var conf map[string]any
	if err := json.Unmarshal(shipped, &conf); err != nil {
		t.Fatalf("deploy/cni/90-ipmasq.conflist: %v", err)
	}
	plugins, _ := conf["plugins"].([]any)
	if len(plugins) == 0 {
		t.Fatal("deploy/cni/90-ipmasq.conflist has no plugins")
	}
	ipam, _ := plugins[0].(map[string]any)["ipam"].(map[string]any)
	if ipam["type"] != "ipmasq-cni" {
		t.Fatalf("deploy/cni/90-ipmasq.conflist: the first plugin's ipam is %v, want ipmasq-cni", ipam["type"])
	}
	ipam["routeTable"] = 11
	data, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	c.node.WriteFile(cniConfigPath, data, 0o644)
}

// waitNodeReady waits for the Node to be Ready with a pod CIDR.
func (c *cluster) waitNodeReady() {
	c.eventually(90*time.Second, "node Ready with a pod CIDR", func() error {
		n, err := c.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if len(n.Spec.PodCIDRs) == 0 {
			return fmt.Errorf("no spec.podCIDRs")
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady && cond.Status != corev1.ConditionTrue {
				return fmt.Errorf("Ready %s: %s", cond.Status, cond.Message)
			}
			if cond.Type == corev1.NodeReady {
				return nil
			}
		}
		return fmt.Errorf("no Ready condition")
	})
}

// serviceProxy stands in for kube-proxy, which a real node runs: the
// in-cluster address of the API server (the kubernetes Service's
// ClusterIP, which the kubelet gives every pod as KUBERNETES_SERVICE_HOST)
// is translated to the API server on the node.
func (c *cluster) serviceProxy() {
	svc, err := c.admin.CoreV1().Services("default").Get(context.Background(), "kubernetes", metav1.GetOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	c.node.MustRun("iptables", "-t", "nat", "-A", "OUTPUT", "-d", svc.Spec.ClusterIP, "-p", "tcp", "--dport", "443",
		"-j", "DNAT", "--to-destination", fmt.Sprintf("%s:%d", kubetest.Addr, kubetest.Port))
}

// podCIDR is the Node's IPv4 pod CIDR.
func (c *cluster) podCIDR() netip.Prefix {
	n, err := c.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	for _, s := range n.Spec.PodCIDRs {
		if p, err := netip.ParsePrefix(s); err == nil && p.Addr().Is4() {
			return p
		}
	}
	c.t.Fatalf("node has no IPv4 pod CIDR: %v", n.Spec.PodCIDRs)
	return netip.Prefix{}
}

// deployAgent installs as docs/deploy.md says: `kubectl create -f
// deploy/config/configmap.yaml`, then `kubectl apply -k deploy/` with an
// operator's overlay that sets the image.
func (c *cluster) deployAgent(image string) {
	kubetest.ApplyFiles(c.t, c.admin, "../../deploy/config/configmap.yaml")
	c.apply("../../deploy", image, nil)
}

// apply renders the kustomization in dir with image and creates its
// objects; edit, if set, changes the rendered YAML first (the uninstall
// Job's node name, as docs/deploy.md's sed does).
func (c *cluster) apply(dir, image string, edit func([]byte) []byte) {
	t := c.t
	data := kubetest.Kustomize(t, dir, image)
	if edit != nil {
		data = edit(data)
	}
	for _, obj := range kubetest.DecodeYAML(t, "kustomize "+dir, data) {
		if err := kubetest.Create(c.admin, obj, false); err != nil {
			t.Fatalf("kustomize %s: %v", dir, err)
		}
	}
}

func setImage(t *testing.T, ds *appsv1.DaemonSet, image string) {
	for i, ctr := range ds.Spec.Template.Spec.Containers {
		if ctr.Name == "ipmasq-agent" {
			ds.Spec.Template.Spec.Containers[i].Image = image
			return
		}
	}
	t.Fatal("deploy/daemonset.yaml: no container ipmasq-agent")
}

// agentPod waits for the DaemonSet's pod on the node to be Ready (its
// readiness probe: the agent's /healthz) and returns it.
func (c *cluster) agentPod(timeout time.Duration) *corev1.Pod {
	var pod *corev1.Pod
	c.eventually(timeout, "the ipmasq-agent pod Ready", func() error {
		pods, err := c.admin.CoreV1().Pods("kube-system").List(context.Background(),
			metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ipmasq-agent"})
		if err != nil {
			return err
		}
		if len(pods.Items) != 1 {
			return fmt.Errorf("%d agent pods", len(pods.Items))
		}
		p := &pods.Items[0]
		if p.DeletionTimestamp != nil {
			return fmt.Errorf("%s is being deleted", p.Name)
		}
		if !podReady(p) {
			return fmt.Errorf("%s not Ready: %s", p.Name, podStatus(p))
		}
		pod = p
		return nil
	})
	return pod
}

func podReady(p *corev1.Pod) bool {
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}

func podStatus(p *corev1.Pod) string {
	var b strings.Builder
	fmt.Fprintf(&b, "phase %s", p.Status.Phase)
	for _, s := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		fmt.Fprintf(&b, "; %s ready=%v restarts=%d", s.Name, s.Ready, s.RestartCount)
		if w := s.State.Waiting; w != nil {
			fmt.Fprintf(&b, " waiting %s: %s", w.Reason, w.Message)
		}
		if term := s.LastTerminationState.Terminated; term != nil {
			fmt.Fprintf(&b, " last exit %d %s", term.ExitCode, term.Reason)
		}
	}
	for _, cond := range p.Status.Conditions {
		if cond.Status != corev1.ConditionTrue && cond.Message != "" {
			fmt.Fprintf(&b, "; %s: %s", cond.Type, cond.Message)
		}
	}
	return b.String()
}

// runPod creates an ordinary pod (the pod image, args) on the node's
// network and waits until it runs.
func (c *cluster) runPod(name string, args ...string) *corev1.Pod {
	off := false
	grace := int64(5)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: map[string]string{"app": "nodee2e"}},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken:  &off,
			TerminationGracePeriodSeconds: &grace,
			RestartPolicy:                 corev1.RestartPolicyNever,
			Containers: []corev1.Container{{
				Name: "app", Image: podImage, ImagePullPolicy: corev1.PullNever, Args: args,
			}},
		},
	}
	c.eventually(30*time.Second, "create pod "+name, func() error {
		// Admission waits for the namespace's default ServiceAccount.
		_, err := c.admin.CoreV1().Pods("default").Create(context.Background(), pod, metav1.CreateOptions{})
		return err
	})
	var out *corev1.Pod
	c.eventually(60*time.Second, "pod "+name+" Running", func() error {
		p, err := c.admin.CoreV1().Pods("default").Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
			return fmt.Errorf("%s", podStatus(p))
		}
		out = p
		return nil
	})
	return out
}

// deletePod deletes a pod through the API and waits until the kubelet has
// removed it.
func (c *cluster) deletePod(ns, name string) {
	ctx := context.Background()
	if err := c.admin.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		c.t.Fatal(err)
	}
	c.eventually(60*time.Second, "pod "+name+" gone", func() error {
		_, err := c.admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			return fmt.Errorf("still there")
		}
		return nil
	})
}

// allocation is one IPAM allocation of the agent.
type allocation = ipamapi.AllocationResponse

// allocations are the agent's IPAM allocations, over its API socket on
// the node.
func (c *cluster) allocations() []allocation {
	list, err := c.tryAllocations()
	if err != nil {
		c.t.Fatalf("agent allocations: %v", err)
	}
	return list
}

func (c *cluster) tryAllocations() ([]allocation, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return ipamapi.NewClient(c.node.Root("/run/ipmasq/api.sock")).List(ctx)
}

// ipRule is one line of `ip -j rule`.
type ipRule struct {
	Priority int    `json:"priority"`
	Src      string `json:"src"`
	SrcLen   int    `json:"srclen"`
	Dst      string `json:"dst"`
	DstLen   int    `json:"dstlen"`
	Table    string `json:"table"`
	Protocol string `json:"protocol"`
}

// rulesFrom are the node's ip rules from src, as "to <dst> lookup <table>".
func (c *cluster) rulesFrom(src netip.Addr) []string {
	out := c.node.MustRun("ip", "-j", "rule", "show")
	var rules []ipRule
	if err := json.Unmarshal([]byte(out), &rules); err != nil {
		c.t.Fatalf("ip -j rule: %v\n%s", err, out)
	}
	var got []string
	for _, r := range rules {
		if r.Src == src.String() {
			got = append(got, fmt.Sprintf("%d: to %s/%d lookup %s", r.Priority, r.Dst, r.DstLen, r.Table))
		}
	}
	slices.Sort(got)
	return got
}

// eventually retries check until it succeeds or timeout passes.
func (c *cluster) eventually(timeout time.Duration, what string, check func() error) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: not after %v: %v", what, timeout, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func mustAddr(t *testing.T, s string) netip.Addr {
	t.Helper()
	a, err := netip.ParseAddr(s)
	if err != nil {
		t.Fatalf("address %q: %v", s, err)
	}
	return a
}
