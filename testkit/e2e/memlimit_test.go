package e2e

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// memCgroup is a memory cgroup the test made: a parent of its own under
// the test process's memory cgroup, and the agent's cgroup in it, with a
// limit. Both are removed when the test ends.
type memCgroup struct {
	v2           bool
	parent, dir  string
	limit, procs string // files
}

// newMemCgroup makes parent/agent with a memory limit of limit bytes, in
// cgroup v2 when its memory controller is usable, else in v1's memory
// hierarchy.
func newMemCgroup(t *testing.T, limit int64) *memCgroup {
	t.Helper()
	data, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	var v1, v2 string
	hasV1 := false
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			v2 = parts[2]
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "memory" {
				v1, hasV1 = parts[2], true
			}
		}
	}
	name := fmt.Sprintf("ipmasq-e2e-memlimit-%d", os.Getpid())
	c := &memCgroup{}
	switch {
	case hasV1:
		c.parent = filepath.Join("/sys/fs/cgroup/memory", v1, name)
		c.dir = filepath.Join(c.parent, "agent")
		c.limit, c.procs = filepath.Join(c.dir, "memory.limit_in_bytes"), filepath.Join(c.dir, "cgroup.procs")
	default:
		// v2: a child of the root (a cgroup with processes cannot give
		// its children controllers), with memory delegated to it.
		c.v2 = true
		root := "/sys/fs/cgroup"
		if !strings.Contains(readFile(t, filepath.Join(root, "cgroup.controllers")), "memory") {
			t.Fatalf("no memory controller in cgroup v2 at %s (own cgroup %s), nor on a v1 hierarchy", root, v2)
		}
		c.parent = filepath.Join(root, name)
		c.dir = filepath.Join(c.parent, "agent")
		c.limit, c.procs = filepath.Join(c.dir, "memory.max"), filepath.Join(c.dir, "cgroup.procs")
	}
	if err := os.Mkdir(c.parent, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// After the agent's cleanup (registered later, run first): the
		// cgroups are empty by then; a removal waits a little for the
		// process's exit to settle.
		for _, d := range []string{c.dir, c.parent} {
			for i := 0; ; i++ {
				err := os.Remove(d)
				if err == nil || os.IsNotExist(err) {
					break
				}
				if i == 50 {
					t.Errorf("remove cgroup %s: %v", d, err)
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
		}
	})
	if c.v2 {
		if err := os.WriteFile(filepath.Join(c.parent, "cgroup.subtree_control"), []byte("+memory"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(c.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(c.limit, []byte(strconv.FormatInt(limit, 10)), 0o644); err != nil {
		t.Fatal(err)
	}
	return c
}

// peak is the cgroup's highest memory use so far, and whether the kernel
// ever had to act at the limit (OOM kills; in v1, hitting the limit).
func (c *memCgroup) peak(t *testing.T) (peak int64, limited string) {
	t.Helper()
	num := func(file string) int64 {
		n, err := strconv.ParseInt(strings.TrimSpace(readFile(t, filepath.Join(c.dir, file))), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if !c.v2 {
		if n := num("memory.failcnt"); n > 0 {
			limited = fmt.Sprintf("memory.failcnt %d", n)
		}
		return num("memory.max_usage_in_bytes"), limited
	}
	for _, l := range strings.Split(readFile(t, filepath.Join(c.dir, "memory.events")), "\n") {
		if f := strings.Fields(l); len(f) == 2 && (f[0] == "oom" || f[0] == "oom_kill") && f[1] != "0" {
			limited += l + " "
		}
	}
	return num("memory.peak"), limited
}

// TestNATMapsFitTheMemoryLimit: a 32-core node whose kube-proxy set
// nf_conntrack_max to 32 768 per core (1 048 576, given through
// --nf-conntrack-max-path, never the host's sysctl) asks for 2 097 152 NAT
// entries a family, more kernel memory than the container's limit holds.
// Started in a cgroup with a 320 MiB limit, the agent sizes its maps to
// fit beside the Go heap, says so in its log and status, and masquerades
// traffic while its cgroup's peak stays under the limit. The same traffic
// runs under Linux MASQUERADE first.
func TestNATMapsFitTheMemoryLimit(t *testing.T) {
	const limit = 320 << 20
	ct := filepath.Join(t.TempDir(), "nf_conntrack_max")
	if err := os.WriteFile(ct, []byte("1048576\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Made here, so that it is removed after the subtests' agents stopped.
	cg := newMemCgroup(t, limit)
	spec := masqueradePods("--nf-conntrack-max-path=" + ct)
	spec.prepareAgent = func(t *testing.T, a *agent) { a.cgroupProcs = cg.procs }
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		checkSource(t, s.topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 20)
		checkSource(t, s.topo, s.ext, topology.RemoteIP6, topology.NodeIP6, 20)
		st := startStream(t, s.topo.Pod, topology.RemoteIP4)
		st.progress(t, 4<<20, "under the memory limit")
		st.stop(t)
		a := s.agent
		if a == nil {
			return
		}
		log := readFile(t, a.log)
		for _, want := range []string{"nf_conntrack_max 1048576 from " + ct, "fewer than the 2097152 entries per family",
			"container memory limit 320 MiB"} {
			if !strings.Contains(log, want) {
				t.Errorf("the agent log does not say %q:\n%s", want, tail(log, 30))
			}
		}
		n4, n6 := a.natMapSize(bpf.MapNATV4), a.natMapSize(bpf.MapNATV6)
		if n4 == 0 || n4 >= 2097152 || n6 != n4 {
			t.Errorf("nat_v4 %d, nat_v6 %d entries: want both below 2097152", n4, n6)
		}
		out := a.status(t)
		if !strings.Contains(out, "NAT size:   ") || !strings.Contains(out, "container memory limit 320 MiB") {
			t.Errorf("status does not say how the NAT maps were sized:\n%s", out)
		}
		peak, limited := cg.peak(t)
		t.Logf("NAT maps %d entries a family; cgroup peak %d MiB of %d MiB", n4, peak>>20, limit>>20)
		if peak >= limit || limited != "" {
			t.Errorf("cgroup peak %d MiB of a %d MiB limit (%s)", peak>>20, limit>>20, limited)
		}
		if a.cmd == nil || a.cmd.ProcessState != nil {
			t.Errorf("the agent is not running")
		}
	})
}

// status is "ipmasq-agent status" of the running agent.
func (a *agent) status(t *testing.T) string {
	t.Helper()
	out, err := exec.Command(agentBin, "status", "--shell-sock-path="+filepath.Join(a.dir, "shell.sock")).CombinedOutput()
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	return string(out)
}
