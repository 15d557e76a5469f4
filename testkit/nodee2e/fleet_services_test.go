package nodee2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// The fleet's Services, all of the echo pod on the second node but
// extsvc, whose one endpoint is the external host's echo.
const (
	svcEcho        = "echo"         // ClusterIP
	svcEchoCluster = "echo-cluster" // NodePort, externalTrafficPolicy Cluster
	svcEchoLocal   = "echo-local"   // NodePort, externalTrafficPolicy Local
	svcExt         = "extsvc"       // NodePort without a selector: 203.0.113.10:8002
)

// fleetServices creates the Services and extsvc's EndpointSlice, and
// returns the NodePorts by Service.
func (f *fleet) fleetServices() map[string]int32 {
	t := f.t
	ctx := context.Background()
	echo := map[string]string{"app": "echo"}
	port := corev1.ServicePort{Name: "echo", Port: podEchoPort, TargetPort: intstr.FromInt32(podEchoPort), Protocol: corev1.ProtocolTCP}
	extPort := corev1.ServicePort{Name: "echo", Port: fleetEchoPort, TargetPort: intstr.FromInt32(fleetEchoPort), Protocol: corev1.ProtocolTCP}
	svcs := []*corev1.Service{
		{ObjectMeta: metav1.ObjectMeta{Name: svcEcho}, Spec: corev1.ServiceSpec{Selector: echo, Ports: []corev1.ServicePort{port}}},
		{ObjectMeta: metav1.ObjectMeta{Name: svcEchoCluster}, Spec: corev1.ServiceSpec{Selector: echo, Ports: []corev1.ServicePort{port},
			Type: corev1.ServiceTypeNodePort, ExternalTrafficPolicy: corev1.ServiceExternalTrafficPolicyCluster}},
		{ObjectMeta: metav1.ObjectMeta{Name: svcEchoLocal}, Spec: corev1.ServiceSpec{Selector: echo, Ports: []corev1.ServicePort{port},
			Type: corev1.ServiceTypeNodePort, ExternalTrafficPolicy: corev1.ServiceExternalTrafficPolicyLocal}},
		{ObjectMeta: metav1.ObjectMeta{Name: svcExt}, Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{extPort},
			Type: corev1.ServiceTypeNodePort, ExternalTrafficPolicy: corev1.ServiceExternalTrafficPolicyCluster}},
	}
	nodePorts := map[string]int32{}
	for _, s := range svcs {
		created, err := f.admin.CoreV1().Services(fleetNamespace).Create(ctx, s, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("service %s: %v", s.Name, err)
		}
		nodePorts[s.Name] = created.Spec.Ports[0].NodePort
	}
	ready, name, proto := true, "echo", corev1.ProtocolTCP
	p := int32(fleetEchoPort)
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: svcExt + "-1", Labels: map[string]string{discoveryv1.LabelServiceName: svcExt}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{masqTarget}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &p, Protocol: &proto}},
	}
	if _, err := f.admin.DiscoveryV1().EndpointSlices(fleetNamespace).Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatalf("EndpointSlice of %s: %v", svcExt, err)
	}
	return nodePorts
}

// askFromOutside connects from the external host, from the masqueraded
// address masqTarget, to addr and returns the answer line. The
// connection only works if the node's replies reach it untranslated: they
// must come from addr.
func (f *fleet) askFromOutside(addr netip.AddrPort) (string, error) {
	var line string
	err := f.ext.Do(func() error {
		d := net.Dialer{Timeout: 2 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(masqTarget)}}
		c, err := d.Dial("tcp", addr.String())
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(2 * time.Second))
		line, err = bufio.NewReader(c).ReadString('\n')
		return err
	})
	return strings.TrimSpace(line), err
}

// checkAnswers waits until pod (on n) has answers from every address of
// want, then fails the test for any answer that is not want's.
func (f *fleet) checkAnswers(n *fleetNode, pod string, want map[string]string) {
	t := f.t
	t.Helper()
	f.eventually(60*time.Second, pod+"'s answers", func() error {
		got := n.answers(pod)
		for addr := range want {
			if len(got[addr]) == 0 {
				return fmt.Errorf("no answer from %s yet (answers: %v)", addr, got)
			}
		}
		return nil
	})
	for addr, answers := range n.answers(pod) {
		for _, a := range answers {
			if w, ok := want[addr]; ok && a != w {
				t.Errorf("pod %s on %s asking %s: answer %q, want %q", pod, n.name, addr, a, w)
			}
		}
	}
}

// conntrackEntry is one line of conntrack -L: the original and the reply
// tuple's addresses.
type conntrackEntry struct {
	line                       string
	origSrc, origDst, replyDst netip.Addr
}

// conntrack lists the node's netfilter connections (conntrack -L).
func (f *fleet) conntrack(n *fleetNode) []conntrackEntry {
	out, err := n.Run("conntrack", "-L")
	if err != nil {
		f.t.Fatal(err)
	}
	var entries []conntrackEntry
	for _, line := range strings.Split(out, "\n") {
		var addrs []netip.Addr
		for _, field := range strings.Fields(line) {
			for _, key := range []string{"src=", "dst="} {
				if v, ok := strings.CutPrefix(field, key); ok {
					if a, err := netip.ParseAddr(v); err == nil {
						addrs = append(addrs, a)
					}
				}
			}
		}
		if len(addrs) >= 4 {
			entries = append(entries, conntrackEntry{line: line, origSrc: addrs[0], origDst: addrs[1], replyDst: addrs[3]})
		}
	}
	return entries
}

// checkOneTranslation fails the test for a connection that kube-proxy's
// masquerade (KUBE-POSTROUTING: a conntrack entry whose reply goes to
// another address than the original source) and ipmasq (a NAT pair) both
// translated, and for a pod's connection kube-proxy translated (ipmasq
// decides for pods' own traffic): every ipmasq pair's original source is
// a pod of the node, and no conntrack entry of a pod's connection is
// source-translated.
func (f *fleet) checkOneTranslation() {
	t := f.t
	t.Helper()
	cluster := netip.MustParsePrefix(clusterCIDR)
	for _, n := range f.nodes {
		if n.stopped {
			continue
		}
		kubeProxy := 0
		for _, e := range f.conntrack(n) {
			if e.replyDst == e.origSrc {
				continue
			}
			kubeProxy++
			if cluster.Contains(e.origSrc) {
				t.Errorf("%s: netfilter masqueraded a pod's connection (ipmasq's to decide): %s", n.name, e.line)
			}
		}
		pairs := f.natPairs(n)
		for _, p := range pairs {
			src, err := netip.ParseAddrPort(p.Original.Src)
			if err != nil {
				t.Fatalf("%s: NAT pair %+v: %v", n.name, p, err)
			}
			if p.Kind == "masquerade" && !n.cidr.Contains(src.Addr()) {
				t.Errorf("%s: ipmasq translated %s -> %s, not a pod of the node (%s): kube-proxy's or the node's own traffic", n.name, p.Original.Src, p.Original.Dst, n.cidr)
			}
		}
		t.Logf("%s: %d connections masqueraded by kube-proxy, %d NAT pairs of ipmasq, none both", n.name, kubeProxy, len(pairs))
	}
}

// testFleetServices is item 1 of issue 31: what every cluster runs, through
// ipmasq. A client pod on the first node asks, through the kube-dns
// Service and CoreDNS (which forwards to the external resolver), the
// external host (masqueraded), a non-masquerade address (its own address
// kept), a ClusterIP Service and a pod on the second node (its own address
// kept: kube-proxy does not masquerade pod traffic), and a Service whose
// endpoint is the external host (translated once, by ipmasq); the external
// host reaches NodePorts (kube-proxy translates for Cluster, nobody for
// Local; the replies come back untranslated).
func testFleetServices(t *testing.T, f *fleet) {
	a, b := f.nodes[0], f.nodes[1]
	server := f.runPodOn(b, "server", map[string]string{"app": "echo"}, "echo", fmt.Sprint(podEchoPort))
	nodePorts := f.fleetServices()
	serverAddr := netip.AddrPortFrom(mustAddr(t, server.Status.PodIP), podEchoPort).String()
	masqName := fmt.Sprintf("masq.example.test.:%d", fleetEchoPort)
	plainName := fmt.Sprintf("plain.example.test.:%d", fleetEchoPort)
	echoName := fmt.Sprintf("%s.%s.svc.cluster.local.:%d", svcEcho, fleetNamespace, podEchoPort)
	extName := fmt.Sprintf("%s.%s.svc.cluster.local.:%d", svcExt, fleetNamespace, fleetEchoPort)
	client := f.runPodOn(a, "client", nil, "ask", masqName, plainName, echoName, serverAddr, extName)
	clientIP := client.Status.PodIP
	f.checkAnswers(a, "client", map[string]string{
		masqName:   a.ip.String() + " ext", // ipmasq
		plainName:  clientIP + " ext",      // non-masquerade CIDR
		echoName:   clientIP + " server",   // ClusterIP, backend on b
		serverAddr: clientIP + " server",   // pod to pod across nodes
		extName:    a.ip.String() + " ext", // ClusterIP to the outside: ipmasq, once
	})
	// CoreDNS' queries reach the external resolver masqueraded, from the
	// address of the node each replica runs on.
	nodeIPs := map[netip.Addr]bool{}
	for _, n := range f.nodes {
		nodeIPs[n.ip] = true
	}
	from := f.dns.sources("masq.example.test.")
	if len(from) == 0 {
		t.Error("the external resolver saw no query for masq.example.test.")
	}
	for src, n := range from {
		if !nodeIPs[src] {
			t.Errorf("the external resolver saw %d queries from %s, want a node's address (CoreDNS masqueraded)", n, src)
		}
	}

	// NodePorts from outside, from a masqueraded address.
	for _, c := range []struct {
		via  *fleetNode
		svc  string
		want string
	}{
		{a, svcEchoCluster, a.ip.String() + " server"}, // kube-proxy masquerades, to b
		// kube-proxy masquerades (Cluster) to the local backend: to the
		// address of the device the pod is behind, ptp's gateway.
		{b, svcEchoCluster, b.cidr.Addr().Next().String() + " server"},
		{b, svcEchoLocal, masqTarget + " server"}, // nobody translates; the reply leaves b untranslated
		{a, svcExt, a.ip.String() + " ext"},       // kube-proxy masquerades, back out of a
	} {
		to := netip.AddrPortFrom(c.via.ip, uint16(nodePorts[c.svc]))
		var got string
		f.eventually(30*time.Second, fmt.Sprintf("NodePort %s via %s", c.svc, c.via.name), func() (err error) {
			got, err = f.askFromOutside(to)
			return err
		})
		if got != c.want {
			t.Errorf("NodePort %s via %s (%s) from %s: answer %q, want %q", c.svc, c.via.name, to, masqTarget, got, c.want)
		}
	}
	f.checkOneTranslation()
	// The agent's report of the netfilter NAT rules that decide before it
	// (docs/migrate.md) leaves kube-proxy's mark-conditioned masquerade
	// out: on every node, nothing decides before ipmasq.
	for _, n := range f.nodes {
		v, err := f.metric(n, "ipmasq_netfilter_nat_rules")
		if err != nil {
			t.Error(err)
		} else if v != "0" {
			t.Errorf("%s with kube-proxy: ipmasq_netfilter_nat_rules %s, want 0 (kube-proxy's KUBE-POSTROUTING is mark-conditioned)", n.name, v)
		}
	}
}

// TestFleet runs ipmasq on a cluster of nodes with kube-proxy and CoreDNS
// (issue 31): one cluster shared by the steps, in order.
func TestFleet(t *testing.T) {
	begin := time.Now()
	f := startFleet(t, 2)
	step := time.Now()
	testFleetServices(t, f)
	t.Logf("services and DNS checked in %v", time.Since(step).Round(time.Millisecond))

	// Every later step runs with a TCP stream through each node's datapath.
	streams := f.startStreams("stream")
	for _, s := range []struct {
		name string
		run  func(*testing.T, *fleet, []*fleetStream)
	}{
		{"config", testFleetConfig},
		{"rollout", testFleetRollout},
		{"socket", testFleetSocketDirRemoved},
		{"outage", testFleetOutage},
		{"lifecycle", testFleetLifecycle},
	} {
		step = time.Now()
		s.run(t, f, streams)
		t.Logf("step %s done in %v", s.name, time.Since(step).Round(time.Millisecond))
	}
	t.Logf("whole test %v", time.Since(begin).Round(time.Millisecond))
}

// agentPodsReady waits until every running node has a Ready agent pod and
// returns them by node name.
func (f *fleet) agentPodsReady(timeout time.Duration) map[string]*corev1.Pod {
	var byNode map[string]*corev1.Pod
	f.eventually(timeout, "an ipmasq-agent pod Ready on every node", func() error {
		pods, err := f.admin.CoreV1().Pods("kube-system").List(context.Background(),
			metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ipmasq-agent"})
		if err != nil {
			return err
		}
		byNode = map[string]*corev1.Pod{}
		for i := range pods.Items {
			p := &pods.Items[i]
			if p.DeletionTimestamp == nil && podReady(p) {
				byNode[p.Spec.NodeName] = p
			}
		}
		for _, n := range f.nodes {
			if !n.stopped && byNode[n.name] == nil {
				return fmt.Errorf("no Ready agent pod on %s", n.name)
			}
		}
		return nil
	})
	return byNode
}

// metric is the value of an unlabelled metric on the agent of n (its
// /metrics).
func (f *fleet) metric(n *fleetNode, name string) (string, error) {
	code, body, err := f.agentGet(n, "/metrics")
	if err != nil {
		return "", err
	}
	if code != http.StatusOK {
		return "", fmt.Errorf("%s's /metrics: HTTP %d", n.name, code)
	}
	for _, l := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(l, name+" "); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("no metric %s on %s", name, n.name)
}

// agentGet asks the agent of n for path on its metrics port (9464 on the
// node's address, asked from the external host) and returns the status
// code and the body.
func (f *fleet) agentGet(n *fleetNode, path string) (int, string, error) {
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (c net.Conn, err error) {
			err = f.ext.Do(func() error {
				c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
	}}
	resp, err := client.Get(fmt.Sprintf("http://%s%s", netip.AddrPortFrom(n.ip, 9464), path))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, "", err
	}
	return resp.StatusCode, string(body), nil
}
