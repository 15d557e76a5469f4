package e2e

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
)

// TestUninstall runs `ipmasq-agent uninstall` on a node namespace where a
// real agent masqueraded pod traffic and wrote ip rules for an endpoint
// with a route table: refused while the agent runs (its lock, its
// sockets), then, once it is stopped, the node holds no tc program (tcx or
// clsact), pin, rule or file of ipmasq, and a second run removes nothing.
// tcx with a SIGKILLed agent (stale sockets left), clsact with a clean
// stop.
func TestUninstall(t *testing.T) {
	for _, c := range []struct {
		mode string
		stop syscall.Signal
	}{{"tcx", syscall.SIGKILL}, {"clsact", syscall.SIGTERM}} {
		t.Run(c.mode, func(t *testing.T) { testUninstall(t, c.mode, c.stop) })
	}
}

func testUninstall(t *testing.T, mode string, stop syscall.Signal) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	startServers(t, topo.Ext, topology.RemoteIP4, topology.RemoteIP6)
	a := newAgent(t, topo.Node, "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n")
	a.args = []string{"--tc-attach-mode=" + mode}
	// What a fresh bpffs holds (the kernel's maps.debug and progs.debug):
	// all that may be left.
	fresh := dirNames(t, a.bpfRoot)
	a.start()
	flags := []string{
		"--bpf-root=" + a.bpfRoot,
		"--state-dir=" + filepath.Join(a.dir, "state"),
		"--api-socket=" + filepath.Join(a.dir, "api.sock"),
		"--shell-sock-path=" + filepath.Join(a.dir, "shell.sock"),
		"--egress-rule-priority=111",
	}

	// 1. Pod traffic through the datapath (NAT state in the pinned maps)
	// and an endpoint with a route table (ip rules of protocol 170).
	for dst, want := range map[netip.Addr]netip.Addr{topology.RemoteIP4: topology.NodeIP4, topology.RemoteIP6: topology.NodeIP6} {
		if src, err := tcpSource(topo.Pod, dst); err != nil || src != want.String() {
			t.Fatalf("pod -> %s: seen from %q (%v), want masqueraded to %s", dst, src, err, want)
		}
	}
	if a.natEntries() == "" {
		t.Fatal("no NAT entries after pod traffic")
	}
	rt := uint32(11)
	for _, family := range []string{"ipv4", "ipv6"} {
		if _, err := ipamapi.NewClient(filepath.Join(a.dir, "api.sock")).Allocate(context.Background(),
			ipamapi.AllocationRequest{Owner: "uninstall/" + family, Family: family, RouteTable: &rt}); err != nil {
			t.Fatalf("allocate %s: %v", family, err)
		}
	}
	a.waitFor("ip rules of both families", func() bool {
		v4, v6 := ownedRules(t, topo.Node, unix.AF_INET), ownedRules(t, topo.Node, unix.AF_INET6)
		return len(v4) > 0 && len(v6) > 0
	})

	// 2. Refused while the agent runs: by its lock (sockets elsewhere),
	// and by its sockets (another state directory); nothing removed.
	for _, refused := range [][]string{
		{"--bpf-root=" + a.bpfRoot, "--state-dir=" + filepath.Join(a.dir, "state"), "--api-socket=" + a.dir + "/none.sock", "--shell-sock-path="},
		{"--bpf-root=" + a.bpfRoot, "--state-dir=" + t.TempDir(), "--api-socket=" + filepath.Join(a.dir, "api.sock")},
	} {
		out, errOut, err := runUninstall(topo.Node, refused)
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || out != "" ||
			!strings.HasPrefix(errOut, "ipmasq-agent: uninstall: an ipmasq-agent is running on this node; stop it first") ||
			strings.Count(errOut, "\n") != 1 {
			t.Fatalf("uninstall %q with the agent running: %v\nstdout %q\nstderr %q\nwant exit 1 and one line saying an agent is running", refused, err, out, errOut)
		}
	}
	if _, err := os.Stat(filepath.Join(a.bpfRoot, "ipmasq", "nat_v4")); err != nil {
		t.Fatalf("a refused uninstall removed pins: %v", err)
	}
	// A second agent on the same state stops at start, naming the lock.
	second := exec.Command(agentBin, "--bpf-root="+a.bpfRoot, "--state-dir="+filepath.Join(a.dir, "state"),
		"--api-socket="+a.dir+"/2.sock", "--shell-sock-path=", "--ip-masq-agent-config-path="+a.config)
	var secondOut bytes.Buffer
	second.Stdout, second.Stderr = &secondOut, &secondOut
	if err := topo.Node.Do(second.Run); err == nil || !strings.Contains(secondOut.String(), "another ipmasq-agent or an uninstall is running") {
		t.Fatalf("a second agent on the same --state-dir: %v\n%s", err, secondOut.String())
	}

	// A second agent on another state directory but the same API socket
	// stops at start on the socket's lock, and leaves the first's socket
	// file as it was: the same inode, still answering.
	apiSock := filepath.Join(a.dir, "api.sock")
	before, err := os.Lstat(apiSock)
	if err != nil {
		t.Fatal(err)
	}
	third := exec.Command(agentBin, "--bpf-root="+a.bpfRoot, "--state-dir="+t.TempDir(),
		"--api-socket="+apiSock, "--shell-sock-path=", "--ip-masq-agent-config-path="+a.config)
	var thirdOut bytes.Buffer
	third.Stdout, third.Stderr = &thirdOut, &thirdOut
	if err := topo.Node.Do(third.Run); err == nil || !strings.Contains(thirdOut.String(), "--api-socket "+apiSock+": is in use by another process") {
		t.Fatalf("a second agent on the same --api-socket: %v\n%s", err, thirdOut.String())
	}
	if after, err := os.Lstat(apiSock); err != nil || !os.SameFile(before, after) {
		t.Fatalf("the first agent's API socket after a second agent tried it: %v (same file: %v)", err, err == nil && os.SameFile(before, after))
	}
	if _, err := ipamapi.NewClient(apiSock).List(context.Background()); err != nil {
		t.Fatalf("the first agent's API after a second agent tried its socket: %v", err)
	}
	// The socket file removed under the running agent (a cleanup of
	// another process): it binds it again and answers there.
	if err := os.Remove(apiSock); err != nil {
		t.Fatal(err)
	}
	a.waitFor("the API socket bound again", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := ipamapi.NewClient(apiSock).List(ctx)
		return err == nil
	})

	// 3. The agent stops; the uninstall removes everything and says what.
	a.stop(stop)
	out, errOut, err := runUninstall(topo.Node, flags)
	if err != nil || errOut != "" {
		t.Fatalf("uninstall: %v\nstdout:\n%s\nstderr:\n%s", err, out, errOut)
	}
	wantLines := []string{"removed pin " + filepath.Join(a.bpfRoot, "ipmasq", "nat_v4"), "removed ip rule", "(protocol 170)",
		"removed state file " + filepath.Join(a.dir, "state", "endpoints.json"), "removed lock file", "removed directory " + filepath.Join(a.bpfRoot, "ipmasq")}
	if mode == "tcx" {
		wantLines = append(wantLines, "detached tcx egress program", "detached tcx ingress program", "from eth0",
			"removed socket "+filepath.Join(a.dir, "api.sock"), "removed socket "+filepath.Join(a.dir, "shell.sock"))
	} else {
		wantLines = append(wantLines, "detached clsact egress filter ipmasq_", "detached clsact ingress filter ipmasq_")
	}
	for _, w := range wantLines {
		if !strings.Contains(out, w) {
			t.Errorf("uninstall output lacks %q:\n%s", w, out)
		}
	}
	if !strings.Contains(out, "uninstall: removed ") {
		t.Errorf("no summary line:\n%s", out)
	}
	leftovers(t, topo.Node, a, fresh)

	// 4. A second run finds nothing.
	out, errOut, err = runUninstall(topo.Node, flags)
	if err != nil || errOut != "" || out != "uninstall: nothing of ipmasq found: nothing removed\n" {
		t.Fatalf("second uninstall: %v\nstdout %q\nstderr %q\nwant only the nothing-removed line", err, out, errOut)
	}
	leftovers(t, topo.Node, a, fresh)
}

// runUninstall runs `ipmasq-agent uninstall` in n, as root with only the
// capabilities the uninstall Job grants (deploy/uninstall/job.yaml:
// NET_ADMIN and BPF), through util-linux's setpriv.
func runUninstall(n *topology.Netns, flags []string) (stdout, stderr string, err error) {
	args := append([]string{"--bounding-set=-all,+net_admin,+bpf", "--inh-caps=-all", agentBin, "uninstall"}, flags...)
	cmd := exec.Command("setpriv", args...)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = n.Do(cmd.Run)
	return o.String(), e.String(), err
}

// ownedRules are the rules of ipmasq's protocol in n.
func ownedRules(t *testing.T, n *topology.Netns, family int) []netlink.Rule {
	t.Helper()
	rules, err := n.NL.RuleList(family)
	if err != nil {
		t.Fatal(err)
	}
	var out []netlink.Rule
	for _, r := range rules {
		if r.Protocol == iprules.Protocol {
			out = append(out, r)
		}
	}
	return out
}

// leftovers fails t for anything of ipmasq in the node: a tc program on
// any device (tcx or a clsact filter), an ip rule of protocol 170, a pin,
// a state file, a socket.
func leftovers(t *testing.T, node *topology.Netns, a *agent, fresh []string) {
	t.Helper()
	links, err := node.NL.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	// Before tcx (6.6) a query of a device's tcx programs is refused
	// (EINVAL), and there are none to find.
	tcx := tcxAvailable(t, node)
	for _, l := range links {
		if tcx {
			tcxLeftovers(t, node, l)
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_EGRESS, netlink.HANDLE_MIN_INGRESS} {
			filters, _ := node.NL.FilterList(l, parent)
			for _, f := range filters {
				t.Errorf("%s: filter left: %+v", l.Attrs().Name, f)
			}
		}
	}
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		for _, r := range ownedRules(t, node, family) {
			t.Errorf("ip rule of protocol %d left: %s", iprules.Protocol, r)
		}
	}
	for _, p := range []string{filepath.Join(a.bpfRoot, "ipmasq"), filepath.Join(a.dir, "state"), filepath.Join(a.dir, "api.sock"), filepath.Join(a.dir, "shell.sock")} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s is left (%v)", p, err)
		}
	}
	if names := dirNames(t, a.bpfRoot); !slices.Equal(names, fresh) {
		t.Errorf("bpffs holds %q, a fresh one %q", names, fresh)
	}
}

// tcxLeftovers fails t for each tcx program attached to l in node.
func tcxLeftovers(t *testing.T, node *topology.Netns, l netlink.Link) {
	t.Helper()
	for _, at := range []ebpf.AttachType{ebpf.AttachTCXEgress, ebpf.AttachTCXIngress} {
		var res *link.QueryResult
		if err := node.Do(func() (err error) {
			res, err = link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: at})
			return err
		}); err != nil {
			t.Fatalf("query tcx programs of %s: %v", l.Attrs().Name, err)
		}
		if len(res.Programs) > 0 {
			t.Errorf("%s: %d tcx %s programs still attached", l.Attrs().Name, len(res.Programs), at)
		}
	}
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}
