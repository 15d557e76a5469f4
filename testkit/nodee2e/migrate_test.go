package nodee2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// The migration of docs/migrate.md on the real node, item 7 of issue 30:
// from the Kubernetes ip-masq-agent itself (tools/ip-masq-agent, its
// source at a pinned commit, in an image with Debian's iptables, from its
// own DaemonSet) to ipmasq (plain `make image`, `kubectl apply -k
// deploy/`), and back. testkit/e2e's TestMigrationKeepsFlows is
// the same order on a bare node namespace, with the reference run without
// the handover that shows what breaks without it.

// upstreamImage is the Kubernetes agent's image as its release builds it
// (Dockerfile.in: the binary at /ip-masq-agent, the entrypoint, over
// registry.k8s.io/build-image/distroless-iptables, which is Debian's
// iptables and the libraries it links): here Debian's iptables of this
// machine (the nft backend), its libraries and extensions.
const upstreamImage = "localhost/ipmasq-nodee2e/ip-masq-agent:" + kubetest.UpstreamAgentVersion

// resolverPort is the external host's UDP resolver (topology.ServeResolver)
// on masqTarget, asked by podprog query.
const resolverPort = 5300

// importUpstreamImage builds the Kubernetes agent's image and imports it
// into the node's containerd.
func (c *cluster) importUpstreamImage() {
	t := c.t
	bin, err := kubetest.UpstreamAgentBinary()
	if err != nil {
		t.Fatalf("the Kubernetes ip-masq-agent: %v", err)
	}
	files := append([]imageFile{{path: "ip-masq-agent", src: bin}}, iptablesFiles(t)...)
	tarball := filepath.Join(c.dir, "ip-masq-agent.tar")
	writeImageFiles(t, tarball, upstreamImage, files, "/ip-masq-agent")
	c.node.MustRun("ctr", "-n", "k8s.io", "images", "import", tarball)
}

// iptablesFiles are Debian's iptables (xtables-nft-multi and the names
// the Kubernetes agent runs it by), its extensions, and every library
// those link (as ldd resolves them), at their paths on this machine.
func iptablesFiles(t *testing.T) []imageFile {
	multi, err := exec.LookPath("xtables-nft-multi")
	if err != nil {
		t.Fatalf("xtables-nft-multi not found (%v): the Debian package iptables has it (.ci/run installs it)", err)
	}
	exts, _ := filepath.Glob("/usr/lib/*/xtables/*.so")
	if len(exts) == 0 {
		t.Fatal("no iptables extensions in /usr/lib/*/xtables: the Debian package iptables has them")
	}
	files := []imageFile{{path: "usr/sbin/xtables-nft-multi", src: multi}}
	for _, name := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		files = append(files, imageFile{path: "usr/sbin/" + name, link: "xtables-nft-multi"})
	}
	libs := map[string]bool{}
	for _, f := range append([]string{multi}, exts...) {
		files = append(files, imageFile{path: strings.TrimPrefix(f, "/"), src: f})
		out, err := exec.Command("ldd", f).Output()
		if err != nil {
			t.Fatalf("ldd %s: %v", f, err)
		}
		for _, field := range strings.Fields(string(out)) {
			if strings.HasPrefix(field, "/") && !libs[field] {
				libs[field] = true
				files = append(files, imageFile{path: strings.TrimPrefix(field, "/"), src: field})
			}
		}
	}
	return files
}

// deployUpstreamAgent creates the Kubernetes agent's own DaemonSet
// (tools/ip-masq-agent/ip-masq-agent.yaml) with its image, and waits until
// its chain is in the node.
func (c *cluster) deployUpstreamAgent() {
	t := c.t
	data, err := os.ReadFile("../../tools/ip-masq-agent/ip-masq-agent.yaml")
	if err != nil {
		t.Fatal(err)
	}
	objs := kubetest.DecodeYAML(t, "ip-masq-agent.yaml", data)
	if len(objs) != 1 {
		t.Fatalf("ip-masq-agent.yaml: %d objects, want its DaemonSet", len(objs))
	}
	ds, ok := objs[0].(*appsv1.DaemonSet)
	if !ok {
		t.Fatalf("ip-masq-agent.yaml: a %T, want its DaemonSet", objs[0])
	}
	ds.Spec.Template.Spec.Containers[0].Image = upstreamImage
	if err := kubetest.Create(c.admin, ds, false); err != nil {
		t.Fatalf("ip-masq-agent.yaml: %v", err)
	}
	c.eventually(90*time.Second, "the Kubernetes agent's chain in the node", func() error {
		if !c.upstreamChainPresent() {
			return fmt.Errorf("no MASQUERADE rule in IP-MASQ-AGENT")
		}
		return nil
	})
}

// upstreamChainPresent says whether the node's nat table has the
// Kubernetes agent's chain with its MASQUERADE rule, jumped to from
// POSTROUTING.
func (c *cluster) upstreamChainPresent() bool {
	rules, err := c.node.Run("iptables", "-t", "nat", "-S")
	return err == nil && strings.Contains(rules, "-A POSTROUTING") && strings.Contains(rules, "-j IP-MASQ-AGENT") &&
		strings.Contains(rules, "-A IP-MASQ-AGENT") && strings.Contains(rules, "-j MASQUERADE")
}

// removeUpstreamAgent deletes the Kubernetes agent's DaemonSet and waits
// for its pod to go (its chain stays in the node, as docs/migrate.md says).
func (c *cluster) removeUpstreamAgent() {
	ctx := context.Background()
	if err := c.admin.AppsV1().DaemonSets("kube-system").Delete(ctx, "ip-masq-agent", metav1.DeleteOptions{}); err != nil {
		c.t.Fatal(err)
	}
	c.eventually(90*time.Second, "the Kubernetes agent's pod gone", func() error {
		pods, err := c.admin.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=ip-masq-agent"})
		if err != nil {
			return err
		}
		if len(pods.Items) > 0 {
			return fmt.Errorf("%d pod(s)", len(pods.Items))
		}
		return nil
	})
}

// docsBlock is the part of doc's first ```sh block that contains first,
// from first to the block's end: lines before it in the block (the
// page's kubectl readiness gate, which the test checks through the API
// itself) are left out.
func docsBlock(t *testing.T, doc, first string) string {
	data, err := os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	for _, part := range strings.Split(string(data), "```sh\n")[1:] {
		block, _, ok := strings.Cut(part, "```")
		if !ok {
			t.Fatalf("%s: a sh block does not end", doc)
		}
		if _, rest, ok := strings.Cut(block, first); ok && (strings.HasPrefix(block, first) || strings.Contains(block, "\n"+first)) {
			return first + rest
		}
	}
	t.Fatalf("%s has no sh block with a line starting with %q", doc, first)
	return ""
}

// agentStatus runs `ipmasq-agent status` in the agent's container, as
// `kubectl exec ds/ipmasq-agent -- ipmasq-agent status` does.
func (c *cluster) agentStatus() (string, error) {
	pod := c.agentPod(30 * time.Second)
	id, ok := strings.CutPrefix(pod.Status.ContainerStatuses[0].ContainerID, "containerd://")
	if !ok {
		return "", fmt.Errorf("agent container ID %q is not containerd's", pod.Status.ContainerStatuses[0].ContainerID)
	}
	return c.node.Run("ctr", "-n", "k8s.io", "tasks", "exec", "--exec-id", fmt.Sprintf("status-%d", time.Now().UnixNano()),
		id, "ipmasq-agent", "status")
}

// addAgentArg adds arg to the rendered ipmasq-agent container's args.
func addAgentArg(t *testing.T, rendered []byte, arg string) []byte {
	const anchor = "- --bpf-root=/sys/fs/bpf\n"
	i := bytes.Index(rendered, []byte(anchor))
	if i < 0 {
		t.Fatalf("the rendered DaemonSet has no %q", anchor)
	}
	indent := i - bytes.LastIndexByte(rendered[:i], '\n') - 1
	line := strings.Repeat(" ", indent) + "- " + arg + "\n"
	at := i + len(anchor)
	return append(rendered[:at:at], append([]byte(line), rendered[at:]...)...)
}

// broken says whether the stream's connection ended (or a second one
// was made) within d.
func (s *stream) broken(d time.Duration) bool {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		conns := s.c.seen.streamsOf(s.pod)
		if len(conns) != 1 {
			return true
		}
		if _, err := conns[0].Progress(); err != nil {
			return true
		}
	}
	return false
}

// handedBack is the count of pairs handed back in a Handover line ("...,
// 57 handed back, ..."); -1 if it has none.
func handedBack(line string) int {
	before, _, ok := strings.Cut(line, " handed back")
	if !ok {
		return -1
	}
	n, err := strconv.Atoi(before[strings.LastIndex(before, " ")+1:])
	if err != nil {
		return -1
	}
	return n
}

// waitHandover waits until the status's Handover line satisfies ok (the
// agent reads netfilter a second after nftables tells of a change, and
// every 30 s), and returns the line.
func (c *cluster) waitHandover(what string, ok func(line string) bool) string {
	var line string
	c.eventually(60*time.Second, "handover "+what, func() error {
		out, err := c.agentStatus()
		if err != nil {
			return err
		}
		for l := range strings.SplitSeq(out, "\n") {
			if v, found := strings.CutPrefix(strings.TrimSpace(l), "Handover:"); found {
				line = strings.TrimSpace(v)
			}
		}
		if !ok(line) {
			return fmt.Errorf("Handover: %s", line)
		}
		return nil
	})
	c.t.Logf("handover %s: %s", what, line)
	return line
}

// queries is the query pod's latest report (podprog query).
type queries struct {
	asked, answered, failed int
	from                    map[string]int
}

// queryReport reads the last report line the query pod logged.
func (c *cluster) queryReport(pod string) (queries, error) {
	logs, _ := filepath.Glob(c.node.Root("/var/log/pods/default_" + pod + "_*/app/*.log"))
	if len(logs) != 1 {
		return queries{}, fmt.Errorf("pod %s: %d log files", pod, len(logs))
	}
	f, err := os.Open(logs[0])
	if err != nil {
		return queries{}, err
	}
	defer f.Close()
	var last string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// CRI log lines: time, stream, tag, then the program's line.
		if fields := strings.SplitN(sc.Text(), " ", 4); len(fields) == 4 && fields[1] == "stdout" && strings.HasPrefix(fields[3], "asked=") {
			last = fields[3]
		}
	}
	if last == "" {
		return queries{}, fmt.Errorf("pod %s: no report yet", pod)
	}
	q := queries{from: map[string]int{}}
	counts := map[string]*int{"asked": &q.asked, "answered": &q.answered, "failed": &q.failed}
	for _, kv := range strings.Fields(last) {
		k, v, _ := strings.Cut(kv, "=")
		if count, ok := counts[k]; ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				return queries{}, fmt.Errorf("pod %s: report %q", pod, last)
			}
			*count = n
			continue
		}
		if k == "from" {
			for src := range strings.SplitSeq(v, ",") {
				if a, n, ok := strings.Cut(src, ":"); ok {
					q.from[a], _ = strconv.Atoi(n)
				}
			}
		}
	}
	return q, nil
}

// TestRealNodeMigration moves a node from the Kubernetes ip-masq-agent to
// ipmasq and back in docs/migrate.md's order, with pods on a CNI that is
// not ipmasq's (calicoBlock), a TCP stream started under each agent and a
// UDP query every 20 ms (each its own flow) running throughout: ipmasq
// installed beside the Kubernetes agent, the Kubernetes agent's DaemonSet
// deleted and its chain removed with the page's own commands, the
// Kubernetes agent back, ipmasq deleted and uninstalled with the page's
// Job. Every stream stays one connection from the node's address, every
// query is answered from the node's address, and no packet reaches the
// external host with a pod's address. The same run with ipmasq's
// --conntrack-handover=false must break (the stream ipmasq translated is
// reset or leaks the pod's address once ipmasq is uninstalled): the
// reference that shows the test sees what the handover prevents.
func TestRealNodeMigration(t *testing.T) {
	t.Run("handover", func(t *testing.T) { testRealNodeMigration(t, true) })
	t.Run("no-handover", func(t *testing.T) { testRealNodeMigration(t, false) })
}

func testRealNodeMigration(t *testing.T, handover bool) {
	begin := time.Now()
	c := startClusterWith(t, "", (*cluster).installBridgeCNI)
	c.importUpstreamImage()
	block := netip.MustParsePrefix(calicoBlock)
	// The bridge's own address (the pods' gateway) is the node's.
	leaks, err := topology.WatchLeaks(c.ext, "eth0", []netip.Addr{block.Addr().Next()}, block)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(leaks.Close)
	resolver, err := topology.ServeResolver(c.ext, netip.AddrPortFrom(netip.MustParseAddr(masqTarget), resolverPort))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resolver.Close() })
	checkQueries := func(after string) {
		t.Helper()
		var q queries
		c.eventually(10*time.Second, "the queries' report", func() error {
			var err error
			q, err = c.queryReport("queries")
			return err
		})
		if q.failed > 0 || q.answered+100 < q.asked || len(q.from) != 1 || q.from[nodeIP] == 0 {
			t.Fatalf("after %s: %d queries asked, %d answered (from %v), %d failed; want every one answered from the node's %s",
				after, q.asked, q.answered, q.from, q.failed, nodeIP)
		}
		t.Logf("after %s: %d queries asked, %d answered, all from the node", after, q.asked, q.answered)
	}

	// 1. The Kubernetes agent decides: its own DaemonSet, the ConfigMap
	// both agents read (deploy/config's, the same name and key).
	kubetest.ApplyFiles(t, c.admin, "../../deploy/config/configmap.yaml")
	c.deployUpstreamAgent()
	underUpstream := c.startStream("under-upstream")
	c.runPod("queries", "query", netip.AddrPortFrom(netip.MustParseAddr(masqTarget), resolverPort).String())
	time.Sleep(2 * time.Second)
	checkQueries("the Kubernetes agent's start")

	// 2. ipmasq beside it: docs/migrate.md step 1 (`kubectl apply -k
	// deploy/`; the ConfigMap is there). It adopts conntrack's bindings of
	// the running flows.
	step := time.Now()
	var edit func([]byte) []byte
	if !handover {
		edit = func(b []byte) []byte {
			return addAgentArg(t, b, "--conntrack-handover=false")
		}
	}
	c.apply("../../deploy", "", edit)
	c.agentPod(90 * time.Second)
	if !handover {
		c.waitHandover("off", func(s string) bool { return strings.HasPrefix(s, "off") })
	} else {
		c.waitHandover("active, flows adopted", func(s string) bool {
			return strings.HasPrefix(s, "active") && !strings.Contains(s, " 0 flow(s) adopted")
		})
	}
	underUpstream.check("ipmasq's install beside the Kubernetes agent")
	checkQueries("ipmasq's install")
	t.Logf("ipmasq beside the Kubernetes agent in %v", time.Since(step).Round(time.Millisecond))

	// 3. The Kubernetes agent out: its DaemonSet deleted, then its chain
	// removed on the node with the page's own loop (its ip6tables half
	// finds nothing: the agent ran without --enable-ipv6).
	c.removeUpstreamAgent()
	if !c.upstreamChainPresent() {
		t.Fatal("the Kubernetes agent's chain went with its DaemonSet: the page's removal step would prove nothing")
	}
	// The page's gate before the loop: the node's ipmasq-agent pod Ready.
	c.agentPod(30 * time.Second)
	removal := docsBlock(t, "../../docs/migrate.md", "for ipt in iptables ip6tables; do")
	out, _ := c.node.Run("sh", "-c", removal)
	if c.upstreamChainPresent() {
		t.Fatalf("docs/migrate.md's removal left the chain:\n%s\n%s", out, c.node.MustRun("iptables", "-t", "nat", "-S"))
	}
	underUpstream.check("the chain's removal")
	// Until the agent's next netfilter scan it still hands new flows back.
	idle := "off"
	if handover {
		idle = c.waitHandover("idle", func(s string) bool { return strings.HasPrefix(s, "idle") })
		if handedBack(idle) < 0 {
			t.Fatalf("no count of pairs handed back in the Handover line %q", idle)
		}
	}
	underIPMasq := c.startStream("under-ipmasq")
	underUpstream.check("ipmasq alone")
	checkQueries("ipmasq alone")

	// 4. Back: the Kubernetes agent's DaemonSet again; once ipmasq sees
	// its chain, it hands its pairs to conntrack.
	c.deployUpstreamAgent()
	if handover {
		c.waitHandover("pairs handed back", func(s string) bool {
			return strings.HasPrefix(s, "active") && handedBack(s) > handedBack(idle)
		})
	} else {
		time.Sleep(5 * time.Second) // the agent's netfilter scan after the change
	}
	underIPMasq.check("the Kubernetes agent's return")
	underUpstream.check("the Kubernetes agent's return")
	checkQueries("the Kubernetes agent's return")

	// 5. ipmasq out: kubectl delete -k deploy/ and the uninstall Job
	// (docs/deploy.md); conntrack translates every flow.
	c.uninstallAgent("")
	if left := c.ipmasqOnNode(); len(left) > 0 {
		t.Errorf("after the uninstall the node still holds:\n%s", strings.Join(left, "\n"))
	}
	if !handover {
		if !underIPMasq.broken(10*time.Second) && len(leaks.Leaked()) == 0 {
			t.Fatal("without the handover, the stream ipmasq translated survived its uninstall without a leak: the test would prove nothing")
		}
		t.Logf("without the handover: the stream ipmasq translated broke when ipmasq went (%d packet(s) reached the external host with a pod's address)", len(leaks.Leaked()))
		return
	}
	underIPMasq.check("ipmasq's uninstall")
	underUpstream.check("ipmasq's uninstall")
	time.Sleep(2 * time.Second)
	checkQueries("ipmasq's uninstall")

	if leaked := leaks.Leaked(); len(leaked) > 0 {
		t.Fatalf("%d packet(s) reached the external host with a pod's address, first: %s", len(leaked), leaked[0])
	}
	t.Logf("whole test %v", time.Since(begin).Round(time.Millisecond))
}
