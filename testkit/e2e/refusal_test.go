package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// A kernel the agent cannot serve is refused at start (docs/deploy.md):
// one line naming the kernel and what it lacks, an exit, so the agent is
// never Ready, and nothing of its own left on the node. The kernel here is
// the one the test runs on with its BTF hidden (an empty /sys/kernel/btf
// in the agent's mount namespace), as on a kernel built without
// CONFIG_DEBUG_INFO_BTF: every variant needs BTF, so every kernel of the
// matrix refuses it the same way. Where the kernel is older than the full
// variant's minimum (5.10 in the kernel matrix), that variant forced with
// --datapath-variant=full is refused too, naming what the kernel lacks.

// startRefused starts a and waits for it to exit, asking /readyz on
// metricsAddr all the while. It fails t unless the agent exits with a
// non-zero status, having written exactly one line that names the kernel's
// release and lacks, and never answered /readyz with 200.
func startRefused(t *testing.T, a *agent, lacks string) {
	t.Helper()
	release := bpf.ProbeKernelRelease()
	before := int64(0)
	if fi, err := os.Stat(a.log); err == nil {
		before = fi.Size()
	}
	a.startProcess()
	cmd := a.cmd
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var exit error
	checks := 0
	deadline := time.After(agentWait)
wait:
	for {
		select {
		case exit = <-exited:
			break wait
		case <-deadline:
			t.Fatalf("the agent still runs %v after its start on a kernel that lacks %s, want it to exit", agentWait, lacks)
		default:
		}
		checks++
		if code, body, err := httpGet(a.node, metricsAddr, "/readyz"); err == nil && code == 200 {
			t.Fatalf("/readyz answered 200 (%q) on a kernel that lacks %s", body, lacks)
		}
		time.Sleep(20 * time.Millisecond)
	}
	a.cmd = nil
	var ee *exec.ExitError
	if !errors.As(exit, &ee) || ee.ExitCode() == 0 {
		t.Errorf("the agent on a kernel that lacks %s ended with %v, want a non-zero exit status", lacks, exit)
	}
	data, err := os.ReadFile(a.log)
	if err != nil {
		t.Fatal(err)
	}
	out := strings.TrimSpace(string(data[before:]))
	lines := strings.Split(out, "\n")
	if len(lines) != 1 || !strings.Contains(out, "kernel "+release) || !strings.Contains(out, lacks) {
		t.Errorf("the agent on a kernel that lacks %s wrote %d lines, want one naming kernel %s and %q:\n%s", lacks, len(lines), release, lacks, out)
	}
	t.Logf("refused after %d /readyz checks, none 200: %s", checks, out)
}

// TestKernelRefused: on a node with no agent before it, the refused agent
// leaves nothing behind: no tc program on any device, no clsact qdisc, no
// ip rule, no pin, no state, no socket.
func TestKernelRefused(t *testing.T) {
	type refusal struct {
		name, lacks string
		hideBTF     bool
		args        []string
	}
	cases := []refusal{{name: "no BTF", lacks: "kernel BTF", hideBTF: true}}
	if f := bpf.ProbeKernel(); len(f.MissingFull) > 0 {
		cases = append(cases, refusal{name: "full forced", lacks: f.MissingFull[0], args: []string{"--datapath-variant=full"}})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			topo, err := topology.NewMasquerade()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { topo.Close() })
			a := newAgent(t, topo.Node, masqueradeAll)
			a.args = append([]string{"--prometheus-serve-addr=" + metricsAddr}, c.args...)
			a.hideKernelBTF = c.hideBTF
			fresh := dirNames(t, a.bpfRoot)
			startRefused(t, a, c.lacks)
			leftovers(t, topo.Node, a, fresh)
			noClsactQdisc(t, topo.Node)
		})
	}
}

// TestRefusedUpgradeKeepsMasquerading: a node runs the agent; its
// replacement (a rolling update's new pod) is refused on the same node.
// The datapath the first one attached stays attached and keeps
// masquerading: a running stream and new flows leave with the node's
// address, the refused agent changes no pin, and the next agent that can
// run takes the datapath over. Under the reference (Linux MASQUERADE) the
// same flows cross a node whose rules stay as they are.
func TestRefusedUpgradeKeepsMasquerading(t *testing.T) {
	spec := masqueradePods()
	spec.agentArgs = append(spec.agentArgs, "--prometheus-serve-addr="+metricsAddr)
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		topo, a := s.topo, s.agent
		stream := startStream(t, topo.Pod, topology.RemoteIP4)
		stream.progress(t, 64<<10, "before the update")
		checkSource(t, topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 3)
		var pins []string
		if a != nil {
			a.stop(syscall.SIGTERM)
			pins = pinTree(t, a.bpfRoot)
			a.hideKernelBTF = true
			startRefused(t, a, "kernel BTF")
			if after := pinTree(t, a.bpfRoot); !slices.Equal(after, pins) {
				t.Errorf("the refused agent changed the pins:\nbefore %q\nafter  %q", pins, after)
			}
		}
		stream.progress(t, 16<<10, "after the refused start")
		checkSource(t, topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 3)
		checkSource(t, topo, s.ext, topology.RemoteIP6, topology.NodeIP6, 3)
		if a != nil {
			// The node gets a kernel (here: its BTF back) the agent
			// serves: the next start takes the datapath over.
			a.hideKernelBTF = false
			a.start()
			stream.progress(t, 16<<10, "after the next agent's start")
			checkSource(t, topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 3)
		}
		stream.stop(t)
	})
}

// pinTree lists every path under root (relative, with each pin's inode, so
// that a pin removed and made again counts as changed).
func pinTree(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	err := filepath.Walk(root, func(path string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		out = append(out, fmt.Sprintf("%s@%d", rel, fi.Sys().(*syscall.Stat_t).Ino))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// noClsactQdisc fails t for each device of n with a clsact qdisc.
func noClsactQdisc(t *testing.T, n *topology.Netns) {
	t.Helper()
	qdiscs, err := n.NL.QdiscList(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range qdiscs {
		if q.Type() == "clsact" {
			t.Errorf("a clsact qdisc on device %d: %+v", q.Attrs().LinkIndex, q.Attrs())
		}
	}
}
