package nodee2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// hostState is what the node must leave alone on the machine: the host's
// network (links, addresses, routes, rules), the sysctls the kubelet and
// the CNI plugins write, and the folders a node's runtime, kubelet, CNI
// and agent would use, and the top level of every cgroup hierarchy.
type hostState map[string]string

// kubeletSysctls are the host-wide sysctls the kubelet rewrites
// (setupKernelTunables); the node shadows them with files of its own.
var kubeletSysctls = []string{
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
}

// hostSysctls are checked: the kubelet's, and the forwarding switches ptp
// turns on (per network namespace: the node's, never the host's).
var hostSysctls = append(append([]string(nil), kubeletSysctls...),
	"net/ipv4/ip_forward", "net/ipv4/conf/all/forwarding", "net/ipv6/conf/all/forwarding")

// hostDirs are listed (names, one level); a missing one is recorded as such.
var hostDirs = []string{
	"/var/log", "/sys/fs/bpf", "/run/containerd", "/run/netns", "/run/ipmasq",
	"/var/lib/kubelet", "/var/lib/containerd", "/var/lib/cni", "/var/lib/ipmasq",
	"/etc/cni", "/opt/cni", "/etc/kubernetes",
}

// snapshotHost reads the host's state. The test process runs in the
// host's network namespace, so `ip` shows the host's.
func snapshotHost(t *testing.T) hostState {
	t.Helper()
	s := hostState{}
	for _, args := range [][]string{
		{"-o", "link"}, {"-o", "addr"}, {"route", "show", "table", "all"},
		{"-6", "route", "show", "table", "all"}, {"rule"}, {"-6", "rule"},
	} {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		s["ip "+strings.Join(args, " ")] = string(out)
	}
	for _, name := range hostSysctls {
		v, err := os.ReadFile("/proc/sys/" + name)
		if err != nil {
			t.Fatal(err)
		}
		s["sysctl "+name] = strings.TrimSpace(string(v))
	}
	for _, d := range hostDirs {
		s["dir "+d] = listDir(d, false)
	}
	hierarchies, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hierarchies {
		if h.IsDir() {
			d := filepath.Join("/sys/fs/cgroup", h.Name())
			s["cgroup "+d] = listDir(d, true)
		}
	}
	return s
}

// listDir names the subdirectories of d, and its files unless dirsOnly
// (a cgroup's control files are the kernel's), or says d is missing.
func listDir(d string, dirsOnly bool) string {
	entries, err := os.ReadDir(d)
	if os.IsNotExist(err) {
		return "(missing)"
	}
	if err != nil {
		return err.Error()
	}
	var names []string
	for _, e := range entries {
		if e.IsDir() {
			names = append(names, e.Name()+"/")
		} else if !dirsOnly {
			names = append(names, e.Name())
		}
	}
	return strings.Join(names, " ")
}

// diff lists what changed between two snapshots.
func (before hostState) diff(after hostState) []string {
	var out []string
	for k, b := range before {
		if a := after[k]; a != b {
			out = append(out, fmt.Sprintf("%s:\n  before: %s\n  after:  %s", k, b, a))
		}
	}
	for k, a := range after {
		if _, ok := before[k]; !ok {
			out = append(out, fmt.Sprintf("%s: new: %s", k, a))
		}
	}
	slices.Sort(out)
	return out
}

// checkHostUnchanged compares the host before the node and after its
// teardown; register it before anything else so it runs last.
func checkHostUnchanged(t *testing.T) {
	before := snapshotHost(t)
	t.Cleanup(func() {
		if d := before.diff(snapshotHost(t)); len(d) > 0 {
			t.Errorf("the node changed the host:\n%s", strings.Join(d, "\n"))
		}
	})
}
