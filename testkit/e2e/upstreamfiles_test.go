package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// Files the upstream agents accept, end to end: each case runs first under
// the real agent (the Kubernetes ip-masq-agent built from
// tools/ip-masq-agent, or Azure's ip-masq-agent-v2 from
// tools/ip-masq-agent-v2) in the node namespace with the case's files, so
// its iptables rules and Linux MASQUERADE decide and translate, then under
// ipmasq started for the first time (no previous good config) with the
// same files. Under both, the pod's TCP, UDP and ICMP flows to each
// destination must reach it from the expected source: the pod's own
// address for the destinations the case leaves unmasqueraded, the node's
// for every other one. The reference must pass first, or the case proves
// nothing.

// linkLocalDst is an address of ext in 169.254.0.0/16, reached through the
// node's default route: both agents leave link-local destinations
// unmasqueraded unless masqLinkLocal is set.
var linkLocalDst = netip.MustParseAddr("169.254.77.1")

// fileProbeDsts are the destinations every case probes.
var fileProbeDsts = []netip.Addr{topology.ExtIP4, topology.ExtIP6, topology.RemoteIP4, topology.RemoteIP6, linkLocalDst}

// realAgentCase is one set of config files under a real upstream agent
// and under ipmasq.
type realAgentCase struct {
	name string
	// files are the config folder's entries (name → content): the
	// reference reads them at /etc/config, ipmasq beside its
	// --ip-masq-agent-config-path (…/config/ip-masq-agent; without an entry
	// of that name, that file is absent).
	files map[string]string
	// reference builds the real agent's binary.
	reference func() (string, error)
	// upstreamArgs are the real agent's, ipmasqArgs ipmasq's.
	upstreamArgs, ipmasqArgs []string
	// keepPodAddress are the destinations of fileProbeDsts the pod's
	// flows must reach from the pod's own address; the others from the
	// node's.
	keepPodAddress []netip.Addr
	// warning, when set, is a substring of the odd-file warning ipmasq
	// must log.
	warning string
}

// TestUpstreamAcceptedFilesEndToEnd: files the Kubernetes ip-masq-agent
// accepts (a key given twice, a second YAML document, resyncInterval: 0s,
// cidrLimit: 0 with an empty list) make ipmasq Ready at its first start,
// with its programs attached, deciding for the pod's flows as the real
// agent's rules do under Linux MASQUERADE.
func TestUpstreamAcceptedFilesEndToEnd(t *testing.T) {
	args := []string{"--enable-ipv6"}
	for _, c := range []realAgentCase{
		{
			// The last value of a repeated key wins (YAML to JSON, then
			// the JSON decoder): remote's prefixes, listed first, are
			// masqueraded; ext's link, listed last, is not.
			name:           "nonMasqueradeCIDRs given twice",
			files:          map[string]string{"ip-masq-agent": "nonMasqueradeCIDRs: [203.0.113.0/24, 2001:db8:ff::/64]\nnonMasqueradeCIDRs: [10.0.0.0/24, 2001:db8::/64]\n"},
			keepPodAddress: []netip.Addr{topology.ExtIP4, topology.ExtIP6, linkLocalDst},
			warning:        "the last value is used",
		},
		{
			// Only the first document is read.
			name:           "a second YAML document",
			files:          map[string]string{"ip-masq-agent": "nonMasqueradeCIDRs: [10.0.0.0/24, 2001:db8::/64]\n---\nnonMasqueradeCIDRs: [203.0.113.0/24, 2001:db8:ff::/64]\n"},
			keepPodAddress: []netip.Addr{topology.ExtIP4, topology.ExtIP6, linkLocalDst},
			warning:        "a second YAML document starts here",
		},
		{
			name:           "resyncInterval: 0s",
			files:          map[string]string{"ip-masq-agent": "nonMasqueradeCIDRs: [203.0.113.0/24, 2001:db8:ff::/64]\nresyncInterval: 0s\n"},
			keepPodAddress: []netip.Addr{topology.RemoteIP4, topology.RemoteIP6, linkLocalDst},
			warning:        "is not above 0; the Kubernetes agent then re-reads the file without pause",
		},
		{
			// Nothing listed: everything but link-local is masqueraded.
			name:           "cidrLimit: 0 with an empty list",
			files:          map[string]string{"ip-masq-agent": "nonMasqueradeCIDRs: []\ncidrLimit: 0\n"},
			keepPodAddress: []netip.Addr{linkLocalDst},
			warning:        "cidrLimit: 0 allows no CIDR",
		},
	} {
		c.reference, c.upstreamArgs, c.ipmasqArgs = kubetest.UpstreamAgentBinary, args, args
		t.Run(c.name, func(t *testing.T) { runAgainstRealAgent(t, c) })
	}
}

// TestIPMasqAgentV2FilesEndToEnd: with ip-masq-agent-v2's flags
// (--ip-masq-agent-v2 --resync-interval=60) and its folder as
// deploy/azure-v2 projects it (no file ip-masq-agent; the cluster's file
// ip-masq-agent-user, AKS's ip-masq-agent-reconciled), ipmasq decides for
// the pod's flows as the real v2 agent does with the same files under
// Linux MASQUERADE.
func TestIPMasqAgentV2FilesEndToEnd(t *testing.T) {
	for _, c := range []realAgentCase{
		{
			// The reconciled CIDRs are not masqueraded; the cluster's
			// file adds none (no RFC 1918 defaults: ext's 10.0.0.2 is
			// masqueraded) and its masqLinkLocal is or-ed in.
			name: "a file without nonMasqueradeCIDRs beside the reconciled one",
			files: map[string]string{
				"ip-masq-agent-user":       "masqLinkLocal: true\n",
				"ip-masq-agent-reconciled": "nonMasqueradeCIDRs: [203.0.113.0/24, 2001:db8:ff::/64]\nmasqLinkLocal: false\n",
			},
			keepPodAddress: []netip.Addr{topology.RemoteIP4, topology.RemoteIP6},
		},
		{
			// v2 lists none for a lone file without the key, where the
			// Kubernetes agent (and ipmasq without the flag) takes the
			// RFC 1918 defaults, ext's 10.0.0.2 among them.
			name:           "a lone file without nonMasqueradeCIDRs",
			files:          map[string]string{"ip-masq-agent-user": "masqLinkLocal: false\n"},
			keepPodAddress: []netip.Addr{linkLocalDst},
		},
	} {
		c.reference = kubetest.UpstreamV2AgentBinary
		c.upstreamArgs = []string{"--enable-ipv6", "--resync-interval=60"}
		c.ipmasqArgs = []string{"--enable-ipv6", "--ip-masq-agent-v2", "--resync-interval=60"}
		t.Run(c.name, func(t *testing.T) { runAgainstRealAgent(t, c) })
	}
}

// runAgainstRealAgent runs c under its real agent, then under ipmasq, each
// on a fresh topology.
func runAgainstRealAgent(t *testing.T, c realAgentCase) {
	t.Helper()
	bin, err := c.reference()
	if err != nil {
		t.Fatalf("the reference agent: %v", err)
	}
	referenceFailed := false
	reference := masquerader{name: "upstream agent", start: func(t *testing.T, topo *topology.Masquerade) {
		t.Cleanup(func() { referenceFailed = t.Failed() })
		startRealAgent(t, topo.Node, bin, c.files, c.upstreamArgs)
	}}
	var a *agent
	ipmasq := masquerader{name: "ipmasq", start: func(t *testing.T, topo *topology.Masquerade) {
		if referenceFailed {
			t.Fatal("the reference (the real agent under Linux MASQUERADE) failed on this topology: the case proves nothing")
		}
		a = newAgent(t, topo.Node, "")
		if err := os.Remove(a.config); err != nil {
			t.Fatal(err)
		}
		for name, content := range c.files {
			if err := os.WriteFile(filepath.Join(filepath.Dir(a.config), name), []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		a.args = append(slices.Clone(c.ipmasqArgs), "--prometheus-serve-addr="+metricsAddr)
		a.start() // the programs attached to eth0
		a.waitReady()
	}}
	runEach(t, []masquerader{reference, ipmasq}, func(t *testing.T, topo *topology.Masquerade) {
		if err := topo.RouteBack(); err != nil {
			t.Fatal(err)
		}
		if err := topo.Ext.Addr("lo", linkLocalDst.String()+"/32"); err != nil {
			t.Fatal(err)
		}
		ext := startServers(t, topo.Ext, topology.ExtIP4, topology.ExtIP6, topology.RemoteIP4, topology.RemoteIP6, linkLocalDst)
		for _, dst := range fileProbeDsts {
			want := topology.NodeIP4
			switch {
			case slices.Contains(c.keepPodAddress, dst) && dst.Is4():
				want = topology.PodIP4
			case slices.Contains(c.keepPodAddress, dst):
				want = topology.PodIP6
			case dst.Is6():
				want = topology.NodeIP6
			}
			checkSource(t, topo, ext, dst, want, 2)
		}
		if a != nil && c.warning != "" {
			// The file is applied, with a warning saying what is odd.
			log, err := os.ReadFile(a.log)
			if err != nil {
				t.Fatal(err)
			}
			if !oddWarningLogged(string(log), c.warning) {
				t.Errorf("no odd-file warning mentioning %q in the agent's log:\n%s", c.warning, grepLines(string(log), "level=WARN"))
			}
		}
	})
}

// oddWarningLogged reports whether the log has a config warning of kind
// odd, at WARN, whose message mentions what.
func oddWarningLogged(log, what string) bool {
	for line := range strings.Lines(log) {
		msg, _, _ := strings.Cut(line, " path=")
		if strings.Contains(line, "level=WARN") && strings.Contains(line, "kind=odd") &&
			strings.Contains(msg, `msg="Config warning: `) && strings.Contains(msg, what) {
			return true
		}
	}
	return false
}

// startRealAgent runs an upstream agent's binary with args in node's
// network namespace and a mount namespace of its own, where an overlay
// over /etc puts files at /etc/config (both agents read that fixed
// folder). Its rules in the node's nat table make Linux MASQUERADE
// translate. It returns once the agent's chain ends in its MASQUERADE rule
// (for IPv6 too with --enable-ipv6), and runs until the test ends.
func startRealAgent(t *testing.T, node *topology.Netns, bin string, files map[string]string, args []string) {
	t.Helper()
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Fatalf("unshare not found (util-linux): %v", err)
	}
	dir := t.TempDir()
	over := filepath.Join(dir, "etc")
	if err := os.MkdirAll(filepath.Join(over, "config"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(over, "config", name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	logPath := filepath.Join(dir, "agent.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	// unshare and sh exec: the process started is the agent.
	cmd := exec.Command(unshare, append([]string{"--mount", "--propagation", "private", "sh", "-c",
		`mount -t overlay overlay -o lowerdir="$1:/etc" /etc || exit 97; shift; exec "$@"`, "sh", over, bin},
		append(slices.Clone(args), "--v=2", "--logtostderr")...)...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := node.Start(cmd); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
		if t.Failed() {
			if data, err := os.ReadFile(logPath); err == nil {
				t.Logf("%s's log:\n%s", filepath.Base(bin), tail(string(data), 40))
			}
		}
	})
	families := []bool{false}
	if slices.Contains(args, "--enable-ipv6") {
		families = append(families, true)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		done := true
		for _, v6 := range families {
			rules, err := natChain(node, v6, "IP-MASQ-AGENT")
			done = done && err == nil && strings.Contains(rules, "-j MASQUERADE")
		}
		if done {
			return
		}
		select {
		case err := <-exited:
			exited <- err
			data, _ := os.ReadFile(logPath)
			t.Fatalf("%s exited (%v) before its chain was written:\n%s", filepath.Base(bin), err, tail(string(data), 40))
		default:
		}
		if time.Now().After(deadline) {
			data, _ := os.ReadFile(logPath)
			t.Fatalf("%s wrote no MASQUERADE rule in 30 s:\n%s", filepath.Base(bin), tail(string(data), 40))
		}
	}
}

// natChain lists a chain of the node's nat table (iptables-nft -S).
func natChain(node *topology.Netns, v6 bool, chain string) (string, error) {
	bin := "iptables-nft"
	if v6 {
		bin = "ip6tables-nft"
	}
	cmd := exec.Command(bin, "-w", "-t", "nat", "-S", chain)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := node.Start(cmd); err != nil {
		return "", err
	}
	if err := cmd.Wait(); err != nil {
		return "", fmt.Errorf("%s: %w: %s", bin, err, out.String())
	}
	return out.String(), nil
}

// waitReady waits until the agent's /readyz (at metricsAddr) answers 200.
func (a *agent) waitReady() {
	a.t.Helper()
	var last string
	deadline := time.Now().Add(15 * time.Second)
	for {
		code, body, err := httpGet(a.node, metricsAddr, "/readyz")
		if err == nil && code == http.StatusOK {
			return
		}
		last = fmt.Sprintf("%d %q (%v)", code, body, err)
		if time.Now().After(deadline) {
			a.t.Fatalf("/readyz never answered 200; last: %s", last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// httpGet asks addr for path from inside n (the connection dialled on the
// thread inside the namespace); unlike scrape, a refused connection (the
// server not up yet) is an error to retry, not a failure.
func httpGet(n *topology.Netns, addr, path string) (int, string, error) {
	var conn net.Conn
	if err := n.Do(func() (err error) {
		conn, err = net.DialTimeout("tcp", addr, time.Second)
		return err
	}); err != nil {
		return 0, "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(2 * time.Second))
	fmt.Fprintf(conn, "GET %s HTTP/1.0\r\nHost: agent\r\n\r\n", path)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(body)), err
}
