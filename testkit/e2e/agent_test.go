package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// agentBin is the ipmasq-agent built once for all tests.
var agentBin string

// agentBinEnv names an ipmasq-agent binary already built, used instead of
// building one.
const agentBinEnv = "IPMASQ_E2E_AGENT"

// agentWait bounds each wait for the agent (started, attached, maps
// written). $IPMASQ_E2E_AGENT_WAIT (a duration) sets it for the kernel
// matrix's qemu guests, where the emulated CPU loads the programs in 10 s
// and more.
var agentWait = 15 * time.Second

const agentWaitEnv = "IPMASQ_E2E_AGENT_WAIT"

// answerWait bounds the wait for the answer to one query of a burst
// (startQueryBurst): a late answer is not a lost one, and under the kernel
// matrix's emulated CPU a loaded guest answers in more than the host's 2 s
// ($IPMASQ_E2E_ANSWER_WAIT, a duration). An answer never sent (a query
// that left unmasqueraded) stays unanswered however long the wait.
var answerWait = 2 * time.Second

const answerWaitEnv = "IPMASQ_E2E_ANSWER_WAIT"

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		dir, err := os.MkdirTemp("", "ipmasq-e2e-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if v := os.Getenv(agentWaitEnv); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				fmt.Fprintf(os.Stderr, "%s=%q: want a positive duration\n", agentWaitEnv, v)
				os.Exit(1)
			}
			agentWait = d
		}
		if v := os.Getenv(answerWaitEnv); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				fmt.Fprintf(os.Stderr, "%s=%q: want a positive duration\n", answerWaitEnv, v)
				os.Exit(1)
			}
			answerWait = d
		}
		agentBin = filepath.Join(dir, "ipmasq-agent")
		if prebuilt := os.Getenv(agentBinEnv); prebuilt != "" {
			// The kernel matrix (testkit/kernelmatrix) runs this
			// binary in qemu guests, where building the agent under an
			// emulated CPU would take minutes: it builds it on the host.
			if _, err := os.Stat(prebuilt); err != nil {
				fmt.Fprintf(os.Stderr, "%s=%s: %v\n", agentBinEnv, prebuilt, err)
				os.Exit(1)
			}
			agentBin = prebuilt
		} else {
			build := exec.Command("go", "build", "-o", agentBin, "github.com/ipmasq/ipmasq/cmd/ipmasq-agent")
			build.Stdout, build.Stderr = os.Stderr, os.Stderr
			if err := build.Run(); err != nil {
				fmt.Fprintln(os.Stderr, "build ipmasq-agent:", err)
				os.Exit(1)
			}
		}
		code := m.Run()
		os.RemoveAll(dir)
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// agent is ipmasq-agent running as a process in the node namespace, with
// a private bpffs, config and state.
type agent struct {
	t       testing.TB
	node    *topology.Netns
	dir     string
	bpfRoot string
	config  string
	log     string
	args    []string // extra agent flags
	// noPodCIDR: start without --pod-cidr (no pod CIDR named at all).
	noPodCIDR bool
	// cgroupProcs, when set, is the cgroup.procs file the agent's process
	// joins before it execs the agent (so everything it allocates, BPF
	// maps included, is charged to that cgroup).
	cgroupProcs string
	// readOnlyProcSys runs the agent in a mount namespace of its own with
	// /proc/sys read-only, as a container runtime mounts it in the
	// DaemonSet's unprivileged container.
	readOnlyProcSys bool
	// hideKernelBTF runs the agent in a mount namespace of its own with an
	// empty /sys/kernel/btf, as on a kernel built without
	// CONFIG_DEBUG_INFO_BTF.
	hideKernelBTF bool
	cmd           *exec.Cmd
}

func newAgent(t testing.TB, node *topology.Netns, config string) *agent {
	privtest.Require(t)
	dir := t.TempDir()
	a := &agent{
		t: t, node: node, dir: dir,
		bpfRoot: privtest.MountBPFFS(t),
		config:  filepath.Join(dir, "config", "ip-masq-agent"),
		log:     filepath.Join(dir, "agent.log"),
	}
	a.writeConfig(config)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("datapath counters:\n%s", a.counters())
		}
		a.stop(syscall.SIGKILL)
		if t.Failed() {
			if data, err := os.ReadFile(a.log); err == nil {
				t.Logf("agent log:\n%s", tail(string(data), 60))
			}
		}
	})
	return a
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (a *agent) writeConfig(content string) {
	a.t.Helper()
	if err := os.MkdirAll(filepath.Dir(a.config), 0o755); err != nil {
		a.t.Fatal(err)
	}
	if err := os.WriteFile(a.config+".tmp", []byte(content), 0o644); err != nil {
		a.t.Fatal(err)
	}
	if err := os.Rename(a.config+".tmp", a.config); err != nil {
		a.t.Fatal(err)
	}
}

// startProcess runs the agent in the node namespace, waiting for nothing.
func (a *agent) startProcess() {
	a.t.Helper()
	logFile, err := os.OpenFile(a.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		a.t.Fatal(err)
	}
	defer logFile.Close()
	a.cmd = exec.Command(agentBin,
		"--bpf-root="+a.bpfRoot,
		"--ip-masq-agent-config-path="+a.config,
		"--state-dir="+filepath.Join(a.dir, "state"),
		"--api-socket="+filepath.Join(a.dir, "api.sock"),
		"--shell-sock-path="+filepath.Join(a.dir, "shell.sock"),
		// Both families: IPv6 is off by default (the Kubernetes agent's
		// default); a test's own args may still turn it off.
		"--enable-ipv6=true",
		"--log-level=debug")
	if !a.noPodCIDR {
		a.cmd.Args = append(a.cmd.Args, "--pod-cidr="+topology.PodCIDR4, "--pod-cidr="+topology.PodCIDR6)
	}
	a.cmd.Args = append(a.cmd.Args, a.args...)
	if a.cgroupProcs != "" {
		a.cmd = exec.Command("/bin/sh", append([]string{"-c", `echo $$ > "$1" && shift && exec "$@"`, "sh", a.cgroupProcs}, a.cmd.Args...)...)
	}
	var mounts []string
	if a.readOnlyProcSys {
		mounts = append(mounts, "mount --bind /proc/sys /proc/sys", "mount -o remount,bind,ro /proc/sys")
	}
	if a.hideKernelBTF {
		mounts = append(mounts, "mount -t tmpfs ipmasq-no-btf /sys/kernel/btf")
	}
	if len(mounts) > 0 {
		// unshare and sh exec the agent: the process is the agent's.
		a.cmd = exec.Command("unshare", append([]string{"--mount", "--propagation", "private", "/bin/sh", "-c",
			strings.Join(mounts, " && ") + ` && exec "$@"`, "sh"}, a.cmd.Args...)...)
	}
	a.cmd.Stdout, a.cmd.Stderr = logFile, logFile
	if err := a.node.Start(a.cmd); err != nil {
		a.t.Fatalf("start agent: %v", err)
	}
}

// start runs the agent and waits until its programs are attached to the
// node's uplink.
func (a *agent) start() {
	a.t.Helper()
	a.startProcess()
	a.waitAttached("eth0")
}

// waitAttached waits until the programs are attached to the node's device
// dev (both hooks): tcx links pinned, or with --tc-attach-mode=clsact,
// filters on the device.
func (a *agent) waitAttached(dev string) {
	a.t.Helper()
	l, err := a.node.NL.LinkByName(dev)
	if err != nil {
		a.t.Fatal(err)
	}
	// clsact: ipmasq's filters (named ipmasq_...) on both hooks.
	clsact := func() bool {
		for _, parent := range []uint32{netlink.HANDLE_MIN_EGRESS, netlink.HANDLE_MIN_INGRESS} {
			fs, err := a.node.NL.FilterList(l, parent)
			if err != nil || !slices.ContainsFunc(fs, func(f netlink.Filter) bool {
				bf, ok := f.(*netlink.BpfFilter)
				return ok && strings.HasPrefix(bf.Name, "ipmasq_")
			}) {
				return false
			}
		}
		return true
	}
	if slices.Contains(a.args, "--tc-attach-mode=clsact") {
		a.waitFor("clsact filters on "+dev, clsact)
		return
	}
	// Auto: tcx links (pinned) where the kernel has tcx (6.6), else
	// clsact filters.
	links := filepath.Join(a.bpfRoot, "ipmasq", "links")
	a.waitFor("programs attached to "+dev, func() bool {
		for _, hook := range []string{"egress", "ingress"} {
			if _, err := os.Stat(filepath.Join(links, fmt.Sprintf("%d-%s", l.Attrs().Index, hook))); err != nil {
				return clsact()
			}
		}
		return true
	})
}

// stop ends the agent with sig (SIGTERM: clean stop; SIGKILL: crash).
func (a *agent) stop(sig syscall.Signal) {
	if a.cmd == nil || a.cmd.Process == nil {
		return
	}
	a.cmd.Process.Signal(sig)
	a.cmd.Wait()
	a.cmd = nil
}

// waitMapHas waits until nonmasq_v4/v6 hold exactly the lines given
// (as printed by "ipmasq-agent maps").
func (a *agent) waitMaps(want string) {
	a.t.Helper()
	var last string
	a.waitFor("maps to hold the config", func() bool {
		last, _ = nonmasqmaps.Format(bpf.Pinned{Dir: filepath.Join(a.bpfRoot, "ipmasq")})
		return last == want
	})
}

func (a *agent) waitFor(what string, cond func() bool) {
	a.t.Helper()
	deadline := time.Now().Add(agentWait)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		if a.cmd != nil && a.cmd.ProcessState != nil {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	a.t.Fatalf("timed out waiting for %s", what)
}

// counters reads the datapath counters from the pinned map.
func (a *agent) counters() string {
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", bpf.MapCounters), nil)
	if err != nil {
		return err.Error()
	}
	defer m.Close()
	vals, err := bpf.ReadCounters(m)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for i, v := range vals {
		if v != 0 {
			fmt.Fprintf(&b, "  %s %d\n", bpf.Counter(i), v)
		}
	}
	return b.String()
}

// natEntries lists the IPv4 NAT entries as "src -> dst => addr:port" lines.
func (a *agent) natEntries() string {
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", bpf.MapNATV4), nil)
	if err != nil {
		return err.Error()
	}
	defer m.Close()
	var b strings.Builder
	var k bpf.NATKeyV4
	var v bpf.NATValV4
	it := m.Iterate()
	for it.Next(&k, &v) {
		fmt.Fprintf(&b, "dir %d %s:%d -> %s:%d => %s:%d\n", k.Dir, bpf.AddrFrom4(k.Src), bpf.HostPort(k.Sport),
			bpf.AddrFrom4(k.Dst), bpf.HostPort(k.Dport), bpf.AddrFrom4(v.Addr), bpf.HostPort(v.Port))
	}
	return b.String()
}
