package nodee2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// The fleet's addresses. Node i (from 1) has 172.31.<i>.2 on eth0, a
// point-to-point link to the external host (172.31.<i>.1), which is also
// the router between the nodes, the API server's namespace and the
// external world: it routes each node's pod CIDR to that node, so pod to
// pod traffic between nodes keeps its addresses.
const (
	fleetDNSIP     = "203.0.113.53" // the external resolver CoreDNS forwards to
	fleetEchoPort  = 8002           // the external host's echo: answers the source it saw
	podEchoPort    = 8080           // podprog echo in the fleet's server pods
	kubeDNSIP      = "10.96.0.10"   // the kube-dns Service
	coreDNSImage   = "localhost/ipmasq-nodee2e/coredns:" + kubetest.CoreDNSVersion
	fleetNamespace = "default"
)

// fleet is a cluster of several nodes with the components every cluster
// runs: kube-proxy (iptables mode) on each node and CoreDNS as the kube-dns
// Deployment. It reuses cluster for the API server, the control plane, the
// external host and the helpers that only need the API; cluster.node is
// unset.
type fleet struct {
	*cluster
	nodes  []*fleetNode
	bins   kubetest.NodeBinaries
	proxy  string // kube-proxy's binary
	cni    map[string][]byte
	images []string
	agent  string // the agent's binary (ipmasq-agent nat on a node)
	dns    *extResolver
}

// fleetNode is one node of the fleet: its own network and mount
// namespaces, containerd, kubelet, kube-proxy and cgroup root.
type fleetNode struct {
	*node
	index int
	name  string
	ip    netip.Addr
	ns    *topology.Netns
	// cidr is the pod CIDR the controller manager gave the Node.
	cidr netip.Prefix
	// stopped is set once the node has been torn down (it left).
	stopped bool
}

// startFleet brings up the control plane, the external host and n Ready
// nodes, each running kube-proxy, then the agent (deploy/), then CoreDNS.
func startFleet(t *testing.T, n int) *fleet {
	t.Helper()
	privtest.Require(t)
	for _, tool := range []string{"containerd", "ctr", "runc", "nsenter", "unshare", "iptables", "ip", "conntrack"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found (%v): the fleet test needs the Debian packages containerd, runc, iptables, iproute2, util-linux and conntrack (.ci/run installs them)", tool, err)
		}
	}
	checkHostUnchanged(t)
	f := &fleet{cluster: &cluster{t: t, dir: t.TempDir(), seen: newExternal(), ctl: map[string]*exec.Cmd{}}}

	begin := time.Now()
	var err error
	if f.bins, err = kubetest.NodeBinariesBuilt(); err != nil {
		t.Fatalf("kubelet, kube-scheduler, kube-controller-manager: %v", err)
	}
	if f.proxy, err = kubetest.ProxyBinary(); err != nil {
		t.Fatalf("kube-proxy: %v", err)
	}
	coredns, err := kubetest.CoreDNSBinary()
	if err != nil {
		t.Fatalf("coredns: %v", err)
	}
	f.images = f.buildImages(agentImageV1)
	// make image's binary for this machine (it builds one per platform).
	f.agent = filepath.Join(f.dir, "bin", "image", "linux-"+runtime.GOARCH, "ipmasq-agent")
	dnsImage := filepath.Join(f.dir, "coredns.tar")
	writeImage(t, dnsImage, coreDNSImage, coredns, "coredns")
	f.images = append(f.images, dnsImage)
	f.cni = f.cniFiles()
	t.Logf("binaries and images ready in %v", time.Since(begin).Round(time.Millisecond))

	begin = time.Now()
	f.api = kubetest.Start(t)
	f.admin = f.api.Client(kubetest.AdminToken)
	f.fleetNetwork()
	f.fleetControlPlane()
	t.Cleanup(func() {
		if t.Failed() {
			for _, p := range []string{"kube-scheduler", "kube-controller-manager"} {
				t.Logf("%s log:\n%s", p, tail(filepath.Join(f.dir, p+".log"), 20))
			}
		}
	})
	for i := 1; i <= n; i++ {
		f.addNode(i)
	}
	// Registered after the nodes' own cleanups, so it runs before them:
	// the Deployments go first (their ReplicaSets would bring back the
	// pods the nodes' teardown deletes), then every pod but the agents',
	// whose CNI DEL needs the agent of its node.
	t.Cleanup(func() {
		ctx := context.Background()
		for _, ns := range []string{"kube-system", fleetNamespace} {
			f.admin.AppsV1().Deployments(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
			f.admin.AppsV1().ReplicaSets(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		}
		notAgent := metav1.ListOptions{LabelSelector: "app.kubernetes.io/name!=ipmasq-agent"}
		for _, ns := range []string{"kube-system", fleetNamespace} {
			f.admin.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, notAgent)
		}
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
			pods, err := f.admin.CoreV1().Pods(corev1.NamespaceAll).List(ctx, notAgent)
			if err != nil || len(pods.Items) == 0 {
				return
			}
		}
		t.Errorf("teardown: pods not deleted by their kubelets after 60 s: %v", podsLeft(f.admin))
	})
	t.Logf("%d nodes Ready with kube-proxy in %v", n, time.Since(begin).Round(time.Millisecond))
	// The agent before CoreDNS: pods on ipmasq's CNI need it (their CNI
	// ADD waits for the agent's IPAM).
	begin = time.Now()
	f.deployAgent(agentImageV1)
	f.agentPodsReady(90 * time.Second)
	t.Logf("agent Ready on %d nodes in %v", n, time.Since(begin).Round(time.Millisecond))
	begin = time.Now()
	f.startCoreDNS()
	t.Logf("CoreDNS Ready in %v", time.Since(begin).Round(time.Millisecond))
	return f
}

// fleetNetwork: the external host (the router), its servers, and the API
// server's namespace behind it.
func (f *fleet) fleetNetwork() {
	t := f.t
	var err error
	if f.ext, err = topology.NewNetns("ext"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.ext.Close)
	for _, step := range []func() error{
		func() error { return f.ext.Addr("lo", masqTarget+"/32") },
		func() error { return f.ext.Addr("lo", plainTarget+"/32") },
		func() error { return f.ext.Addr("lo", fleetDNSIP+"/32") },
		func() error { return f.ext.Sysctl("net/ipv4/ip_forward", "1") },
		func() error { return (&topology.Cluster{Ext: f.ext}).ConnectAPI(f.api.Netns, kubetest.Addr) },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	f.seen.serveDial(t, f.ext, dialPort)
	f.seen.serveStream(t, f.ext, streamPort)
	// The echo the pods ask: it answers the source address it saw.
	serve(t, f.ext, fleetEchoPort, func(c net.Conn) {
		fmt.Fprintf(c, "%s ext\n", remote(c))
		c.Close()
	})
	if f.dns, err = serveResolver(t, f.ext, netip.MustParseAddr(fleetDNSIP)); err != nil {
		t.Fatal(err)
	}
}

// fleetControlPlane runs kube-scheduler and kube-controller-manager with
// the controllers a fleet needs besides the single node's: deployment and
// replicaset (CoreDNS), endpointslice (every Service kube-proxy programs)
// and podgc (the pods of a deleted Node).
func (f *fleet) fleetControlPlane() {
	kubeconfig := filepath.Join(f.dir, "admin.kubeconfig")
	f.api.WriteKubeconfig(kubeconfig, kubetest.AdminToken)
	f.startControl("kube-scheduler", f.bins.Scheduler, "--kubeconfig="+kubeconfig, "--leader-elect=false", "--secure-port=0")
	f.startControl("kube-controller-manager", f.bins.ControllerManager, "--kubeconfig="+kubeconfig,
		"--leader-elect=false", "--secure-port=0",
		"--controllers=daemonset,deployment,replicaset,endpointslice,serviceaccount,root-ca-cert-publisher,nodeipam,nodelifecycle,garbagecollector,job,podgc",
		"--allocate-node-cidrs", "--cluster-cidr="+clusterCIDR, "--node-cidr-mask-size=24",
		"--service-cluster-ip-range=10.96.0.0/16", "--root-ca-file="+f.api.CertFile)
}

// cniFiles builds ipmasq-cni, ptp and loopback once for every node.
func (f *fleet) cniFiles() map[string][]byte {
	files := map[string][]byte{}
	bin := filepath.Join(f.dir, "cni")
	for _, pkg := range []string{
		"github.com/ipmasq/ipmasq/cmd/ipmasq-cni",
		"github.com/containernetworking/plugins/plugins/main/ptp",
		"github.com/containernetworking/plugins/plugins/main/loopback",
	} {
		data, err := os.ReadFile(goBuild(f.t, bin, pkg))
		if err != nil {
			f.t.Fatal(err)
		}
		files["/opt/cni/bin/"+filepath.Base(pkg)] = data
	}
	conf, err := os.ReadFile("../../deploy/cni/" + filepath.Base(cniConfigPath))
	if err != nil {
		f.t.Fatal(err)
	}
	files[cniConfigPath] = conf
	return files
}

// nodeLogs shows the end of a node's logs and its kube-system pods'.
func (f *fleet) nodeLogs(n *fleetNode) {
	t := f.t
	for _, p := range []string{"kubelet", "containerd", "kube-proxy"} {
		t.Logf("%s %s errors:\n%s", n.name, p, n.LogErrors(p, 15))
	}
	logs, _ := filepath.Glob(n.Root("/var/log/pods/kube-system_*/*/*.log"))
	for _, l := range logs {
		t.Logf("%s %s:\n%s", n.name, l, tail(l, 20))
	}
}

// addNode brings node i up to Ready with kube-proxy running: its network
// (eth0 to the router), its namespaces, ipmasq's CNI (deploy/cni as
// shipped), containerd with the images, the kubelet, and the router's
// route to its pod CIDR once the controller manager has given it one.
func (f *fleet) addNode(i int) *fleetNode {
	t := f.t
	name := fmt.Sprintf("node-%d", i)
	ip := netip.AddrFrom4([4]byte{172, 31, byte(i), 2})
	ns, err := topology.NewNetns(fmt.Sprintf("node%d", i))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.Close)
	uplink := fmt.Sprintf("n%d", i)
	router := fmt.Sprintf("172.31.%d.1", i)
	for _, step := range []func() error{
		func() error { return topology.Veth(ns, "eth0", f.ext, uplink, 0) },
		func() error { return ns.Addr("eth0", ip.String()+"/24") },
		func() error { return f.ext.Addr(uplink, router+"/24") },
		func() error { return ns.Route("default", router, "eth0") },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	n := &fleetNode{node: startNode(t, ns), index: i, name: name, ip: ip, ns: ns}
	// One cgroup root per node: the nodes share the machine's hierarchies.
	n.cgroupRoot += "-" + name
	f.nodes = append(f.nodes, n)
	t.Cleanup(func() {
		if !n.stopped {
			n.stop(f.admin)
			n.stopped = true
		}
	})
	t.Cleanup(func() {
		if t.Failed() && !n.stopped {
			f.nodeLogs(n)
		}
	})
	for path, data := range f.cni {
		mode := os.FileMode(0o755)
		if path == cniConfigPath {
			mode = 0o644
		}
		n.WriteFile(path, data, mode)
	}
	n.startContainerd(f.images...)
	f.startFleetKubelet(n)
	f.waitFleetNodeReady(n)
	if err := f.ext.Route(n.cidr.String(), ip.String(), uplink); err != nil {
		t.Fatal(err)
	}
	f.startKubeProxy(n)
	return n
}

// fleetKubeletConfig is the single node's KubeletConfiguration with the
// node's own address and the cluster's DNS: pods resolve through the
// kube-dns Service, and CoreDNS (dnsPolicy Default) through the node's
// resolv.conf, which names the external resolver.
func fleetKubeletConfig(t *testing.T, n *fleetNode) string {
	conf := strings.Replace(kubeletConfig, "address: "+nodeIP+"\n", "address: "+n.ip.String()+"\n", 1)
	if conf == kubeletConfig {
		t.Fatalf("kubeletConfig has no line address: %s", nodeIP)
	}
	return conf + "cgroupRoot: /" + n.cgroupRoot + "\n" +
		"clusterDNS: [" + kubeDNSIP + "]\nclusterDomain: cluster.local\n"
}

func (f *fleet) startFleetKubelet(n *fleetNode) {
	t := f.t
	if err := makeCgroups(n.cgroupRoot); err != nil {
		t.Fatal(err)
	}
	n.WriteFile("/etc/kubernetes/kubelet.yaml", []byte(fleetKubeletConfig(t, n)), 0o644)
	n.WriteFile("/etc/kubernetes/resolv.conf", []byte("nameserver "+fleetDNSIP+"\n"), 0o644)
	kubeconfig := filepath.Join(n.dir, "kubelet.kubeconfig")
	f.api.WriteKubeconfig(kubeconfig, kubetest.AdminToken)
	n.Start("kubelet", f.bins.Kubelet, "--config=/etc/kubernetes/kubelet.yaml", "--kubeconfig="+kubeconfig,
		"--hostname-override="+n.name, "--node-ip="+n.ip.String())
}

// waitFleetNodeReady waits for the Node to be Ready with a pod CIDR and
// records the CIDR.
func (f *fleet) waitFleetNodeReady(n *fleetNode) {
	f.eventually(90*time.Second, n.name+" Ready with a pod CIDR", func() error {
		node, err := f.admin.CoreV1().Nodes().Get(context.Background(), n.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if len(node.Spec.PodCIDRs) == 0 {
			return fmt.Errorf("no spec.podCIDRs")
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				if cond.Status != corev1.ConditionTrue {
					return fmt.Errorf("Ready %s: %s", cond.Status, cond.Message)
				}
				n.cidr, err = netip.ParsePrefix(node.Spec.PodCIDRs[0])
				return err
			}
		}
		return fmt.Errorf("no Ready condition")
	})
}

// kubeProxyConfig is kube-proxy's configuration on a node. iptables mode:
// it is still kube-proxy's default on Linux and the mode most clusters run,
// its KUBE-POSTROUTING chain is the masquerade the agent's netfilter report
// (docs/migrate.md) knows and leaves out, and the node's iptables is
// iptables-nft, the same netfilter the reference masquerade of ipmasq's
// datapath tests uses. clusterCIDR makes it masquerade Service traffic from
// outside the pods only (detectLocalMode ClusterCIDR, kube-proxy's
// default). The conntrack settings are zero so that it leaves the
// machine-wide nf_conntrack_max and hashsize (and the node's timeouts)
// alone; kube-proxy runs as a program on the node, as the kubelet does (a
// static binary needs the node's iptables, which an image of its own
// would have to carry).
const kubeProxyConfig = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: ` + clusterCIDR + `
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
  udpTimeout: 0s
  udpStreamTimeout: 0s
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
nodePortAddresses: [primary]
`

// startKubeProxy runs kube-proxy on the node and waits until it has
// programmed the kubernetes Service.
func (f *fleet) startKubeProxy(n *fleetNode) {
	kubeconfig := filepath.Join(n.dir, "kube-proxy.kubeconfig")
	f.api.WriteKubeconfig(kubeconfig, kubetest.AdminToken)
	conf := kubeProxyConfig + "hostnameOverride: " + n.name + "\nclientConnection:\n  kubeconfig: " + kubeconfig + "\n"
	n.WriteFile("/etc/kubernetes/kube-proxy.yaml", []byte(conf), 0o644)
	n.Start("kube-proxy", f.proxy, "--config=/etc/kubernetes/kube-proxy.yaml")
	f.eventually(60*time.Second, n.name+"'s kube-proxy programming default/kubernetes", func() error {
		out, err := n.Run("iptables", "-t", "nat", "-S", "KUBE-SERVICES")
		if err != nil {
			return err
		}
		if !strings.Contains(out, "default/kubernetes:https") {
			return fmt.Errorf("KUBE-SERVICES:\n%s", out)
		}
		return nil
	})
}

// startCoreDNS deploys CoreDNS as kubeadm does (testdata/coredns.yaml:
// its RBAC, Corefile, two-replica Deployment spread over the nodes and the
// kube-dns Service) and waits for both replicas to be Ready.
func (f *fleet) startCoreDNS() {
	data, err := os.ReadFile("testdata/coredns.yaml")
	if err != nil {
		f.t.Fatal(err)
	}
	data = []byte(strings.ReplaceAll(string(data), "@IMAGE@", coreDNSImage))
	for _, obj := range kubetest.DecodeYAML(f.t, "testdata/coredns.yaml", data) {
		if err := kubetest.Create(f.admin, obj, false); err != nil {
			f.t.Fatalf("testdata/coredns.yaml: %v", err)
		}
	}
	f.eventually(120*time.Second, "CoreDNS Ready", func() error {
		pods, err := f.admin.CoreV1().Pods("kube-system").List(context.Background(), metav1.ListOptions{LabelSelector: "k8s-app=kube-dns"})
		if err != nil {
			return err
		}
		ready := 0
		for _, p := range pods.Items {
			if podReady(&p) {
				ready++
			} else {
				err = fmt.Errorf("%s on %s: %s", p.Name, p.Spec.NodeName, podStatus(&p))
			}
		}
		if ready < 2 {
			return fmt.Errorf("%d of %d Ready: %v", ready, len(pods.Items), err)
		}
		return nil
	})
}

// runPodOn creates an ordinary pod on node (the pod image, args) and
// waits until it runs.
func (f *fleet) runPodOn(n *fleetNode, name string, labels map[string]string, args ...string) *corev1.Pod {
	off := false
	grace := int64(2)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: fleetNamespace, Labels: labels},
		Spec: corev1.PodSpec{
			NodeName:                      n.name,
			AutomountServiceAccountToken:  &off,
			TerminationGracePeriodSeconds: &grace,
			RestartPolicy:                 corev1.RestartPolicyNever,
			Containers: []corev1.Container{{
				Name: "app", Image: podImage, ImagePullPolicy: corev1.PullNever, Args: args,
			}},
		},
	}
	f.eventually(30*time.Second, "create pod "+name, func() error {
		_, err := f.admin.CoreV1().Pods(fleetNamespace).Create(context.Background(), pod, metav1.CreateOptions{})
		return err
	})
	var out *corev1.Pod
	f.eventually(60*time.Second, "pod "+name+" Running", func() error {
		p, err := f.admin.CoreV1().Pods(fleetNamespace).Get(context.Background(), name, metav1.GetOptions{})
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

// answers are the lines a `podprog ask` pod printed, by the address it
// asked: what the server answered (the source it saw, its name). Read
// from the node's container log, so it works without the API server.
func (n *fleetNode) answers(pod string) map[string][]string {
	logs, _ := filepath.Glob(n.Root(fmt.Sprintf("/var/log/pods/%s_%s_*/app/*.log", fleetNamespace, pod)))
	out := map[string][]string{}
	for _, l := range logs {
		data, err := os.ReadFile(l)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n") {
			// CRI log format: time stream tag message.
			fields := strings.SplitN(line, " ", 4)
			if len(fields) < 4 || fields[1] != "stdout" {
				continue
			}
			addr, answer, ok := strings.Cut(fields[3], " ")
			if ok {
				out[addr] = append(out[addr], answer)
			}
		}
	}
	return out
}

// natPair is one line of `ipmasq-agent nat -o json`.
type natPair struct {
	Kind     string `json:"kind"`
	Proto    string `json:"proto"`
	Original struct {
		Src string `json:"src"`
		Dst string `json:"dst"`
	} `json:"original"`
	Translated struct {
		Src string `json:"src"`
	} `json:"translated"`
}

// natPairs are ipmasq's NAT pairs on the node, read from its pinned maps
// with the agent's own `ipmasq-agent nat`.
func (f *fleet) natPairs(n *fleetNode) []natPair {
	out, err := n.Run(f.agent, "nat", "-o", "json")
	if err != nil {
		f.t.Fatal(err)
	}
	var pairs []natPair
	if err := json.Unmarshal([]byte(out), &pairs); err != nil {
		f.t.Fatalf("ipmasq-agent nat -o json on %s: %v\n%s", n.name, err, out)
	}
	return pairs
}
