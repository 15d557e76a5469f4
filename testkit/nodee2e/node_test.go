package nodee2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// The node's network: eth0 towards the external host, api0 towards the
// API server's namespace (kubetest.Addr routed through it).
const (
	nodeName    = "node-1"
	nodeIP      = "172.30.0.2"
	extIP       = "172.30.0.1"
	nodeAPIIP   = "10.98.0.2"
	apiPeerIP   = "10.98.0.1"
	clusterCIDR = "10.244.0.0/16"
)

// node is a Kubernetes node: containerd and the kubelet in a network
// namespace and a mount namespace of their own. The mount namespace has
// private /run, /var/lib and /var/log (tmpfs), /etc and /opt as overlays of
// the host's (so what an operator installs there stays in the node), its
// own bpffs at /sys/fs/bpf, and files over the host-wide sysctls the
// kubelet rewrites. Everything an operator would do "on the node" goes
// through Run or Root.
type node struct {
	t      *testing.T
	dir    string
	anchor *exec.Cmd // sleeps in the namespaces and holds the mount namespace
	procs  map[string]*exec.Cmd
	// cgroupRoot is the kubelet's cgroupRoot: the node's pods and their
	// QoS cgroups live under it in every hierarchy, not in a "kubepods"
	// the machine's own kubelet may use; stop removes it.
	cgroupRoot string
}

// startNode creates the node's namespaces; nothing runs in them yet.
func startNode(t *testing.T, netns *topology.Netns) *node {
	t.Helper()
	n := &node{t: t, dir: t.TempDir(), procs: map[string]*exec.Cmd{},
		cgroupRoot: fmt.Sprintf("ipmasq-nodee2e-%d", os.Getpid())}
	n.anchor = exec.Command("unshare", "--mount", "--propagation", "private", "sleep", "infinity")
	n.anchor.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := netns.Start(n.anchor); err != nil {
		t.Fatalf("node mount namespace: %v", err)
	}
	t.Cleanup(func() {
		n.anchor.Process.Kill()
		n.anchor.Wait()
	})
	// unshare has made the new namespace before it execs sleep.
	self, _ := os.Readlink("/proc/self/ns/mnt")
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if ns, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", n.Pid())); ns != "" && ns != self {
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", n.anchor.Process.Pid)); strings.HasSuffix(exe, "/sleep") {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("unshare did not create the node's mount namespace")
		}
	}
	for _, d := range []string{"etc-upper", "etc-work", "opt-upper", "opt-work", "sysctl"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mounts := [][]string{
		{"-t", "tmpfs", "node-run", "/run"},
		{"-t", "tmpfs", "node-varlib", "/var/lib"},
		{"-t", "tmpfs", "node-varlog", "/var/log"},
		{"-t", "overlay", "node-etc", "-o", "lowerdir=/etc,upperdir=" + n.dir + "/etc-upper,workdir=" + n.dir + "/etc-work", "/etc"},
		{"-t", "overlay", "node-opt", "-o", "lowerdir=/opt,upperdir=" + n.dir + "/opt-upper,workdir=" + n.dir + "/opt-work", "/opt"},
		{"-t", "bpf", "bpf", "/sys/fs/bpf"},
	}
	for _, name := range kubeletSysctls {
		v, err := os.ReadFile("/proc/sys/" + name)
		if err != nil {
			t.Fatal(err)
		}
		f := filepath.Join(n.dir, "sysctl", strings.ReplaceAll(name, "/", "."))
		if err := os.WriteFile(f, v, 0o644); err != nil {
			t.Fatal(err)
		}
		mounts = append(mounts, []string{"--bind", f, "/proc/sys/" + name})
	}
	for _, m := range mounts {
		n.MustRun(append([]string{"mount"}, m...)...)
	}
	// Shared inside the node (the kubelet and HostToContainer volumes need
	// it); the namespace was made private first, so nothing reaches the host.
	n.MustRun("mount", "--make-rshared", "/")
	return n
}

// Pid is a process in the node's namespaces.
func (n *node) Pid() int { return n.anchor.Process.Pid }

// Root is path as the node sees it (through /proc/<pid>/root).
func (n *node) Root(path string) string {
	return fmt.Sprintf("/proc/%d/root%s", n.Pid(), path)
}

// command is args run in the node's network and mount namespaces.
func (n *node) command(args ...string) *exec.Cmd {
	return exec.Command("nsenter", append([]string{"-t", strconv.Itoa(n.Pid()), "-m", "-n", "--"}, args...)...)
}

// Run runs a command on the node and returns its combined output.
func (n *node) Run(args ...string) (string, error) {
	out, err := n.command(args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("on the node: %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// MustRun is Run that fails the test.
func (n *node) MustRun(args ...string) string {
	n.t.Helper()
	out, err := n.Run(args...)
	if err != nil {
		n.t.Fatal(err)
	}
	return out
}

// Start starts a long-running program on the node, its output in
// <dir>/<name>.log.
func (n *node) Start(name string, args ...string) {
	n.t.Helper()
	log, err := os.Create(filepath.Join(n.dir, name+".log"))
	if err != nil {
		n.t.Fatal(err)
	}
	defer log.Close()
	cmd := n.command(args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		n.t.Fatalf("start %s: %v", name, err)
	}
	n.procs[name] = cmd
}

// Stop ends a program started with Start (SIGTERM, then SIGKILL).
func (n *node) Stop(name string) {
	cmd := n.procs[name]
	if cmd == nil {
		return
	}
	delete(n.procs, name)
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

// LogErrors are the last error lines of a program's log (klog's E, or
// logrus' level=error).
func (n *node) LogErrors(name string, lines int) string {
	data, err := os.ReadFile(filepath.Join(n.dir, name+".log"))
	if err != nil {
		return err.Error()
	}
	var errs []string
	for _, l := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(l, "E") || strings.Contains(l, "level=error") {
			errs = append(errs, l)
		}
	}
	if len(errs) > lines {
		errs = errs[len(errs)-lines:]
	}
	return strings.Join(errs, "\n")
}

func tail(file string, lines int) string {
	data, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	l := strings.Split(strings.TrimSpace(string(data)), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// WriteFile writes a file on the node (an operator's host step).
func (n *node) WriteFile(path string, data []byte, mode os.FileMode) {
	n.t.Helper()
	if err := os.MkdirAll(n.Root(filepath.Dir(path)), 0o755); err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(n.Root(path), data, mode); err != nil {
		n.t.Fatal(err)
	}
}

// containerdConfig is containerd 1.6's config for the node: the defaults
// (/var/lib/containerd, /run/containerd, CNI in /opt/cni/bin and
// /etc/cni/net.d, all private to the node) and two settings this machine
// needs: the sandbox image (there is no registry) and
// restrict_oom_score_adj (the test runs without CAP_SYS_RESOURCE in its
// bounding set, so runc cannot lower a sandbox's oom_score_adj).
const containerdConfig = `version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "` + pauseImage + `"
  restrict_oom_score_adj = true
`

// startContainerd runs containerd on the node and imports the image
// tarballs (`ctr -n k8s.io images import`, as an operator without a
// registry would).
func (n *node) startContainerd(images ...string) {
	n.t.Helper()
	if _, err := exec.LookPath("containerd"); err != nil {
		n.t.Fatalf("containerd not found (%v): install the Debian packages containerd and runc (.ci/run does)", err)
	}
	n.WriteFile("/etc/containerd/config.toml", []byte(containerdConfig), 0o644)
	n.Start("containerd", "containerd", "--config", "/etc/containerd/config.toml")
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, err := n.Run("ctr", "version"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("containerd did not start:\n%s", tail(filepath.Join(n.dir, "containerd.log"), 30))
		}
	}
	for _, img := range images {
		n.MustRun("ctr", "-n", "k8s.io", "images", "import", img)
	}
}

// kubeletConfig is the node's KubeletConfiguration. Three settings are for
// this machine (cgroup v1 with the cgroupfs driver, swap); syncFrequency is
// short so a ConfigMap edit reaches the pod in seconds, not a minute.
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
address: ` + nodeIP + `
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
resolvConf: /etc/kubernetes/resolv.conf
evictionHard: {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 10s
`

// startKubelet registers the node with the API server.
func (n *node) startKubelet(api *kubetest.Server, bin string) {
	n.t.Helper()
	if err := makeCgroups(n.cgroupRoot); err != nil {
		n.t.Fatal(err)
	}
	n.WriteFile("/etc/kubernetes/kubelet.yaml", []byte(kubeletConfig+"cgroupRoot: /"+n.cgroupRoot+"\n"), 0o644)
	n.WriteFile("/etc/kubernetes/resolv.conf", []byte("nameserver 127.0.0.1\n"), 0o644)
	kubeconfig := filepath.Join(n.dir, "kubelet.kubeconfig")
	api.WriteKubeconfig(kubeconfig, kubetest.AdminToken)
	n.Start("kubelet", bin, "--config=/etc/kubernetes/kubelet.yaml", "--kubeconfig="+kubeconfig,
		"--hostname-override="+nodeName, "--node-ip="+nodeIP)
}

// stop deletes every pod through the API (so the kubelet runs CNI DEL),
// then stops the kubelet, containerd, the shims and any container left,
// and removes the node's cgroup root (never a "kubepods" of the machine).
func (n *node) stop(c kubernetes.Interface) {
	ctx := context.Background()
	orphan := metav1.DeletePropagationOrphan
	for _, ns := range []string{"kube-system", "default"} {
		dss, _ := c.AppsV1().DaemonSets(ns).List(ctx, metav1.ListOptions{})
		for _, ds := range dss.Items {
			c.AppsV1().DaemonSets(ns).Delete(ctx, ds.Name, metav1.DeleteOptions{PropagationPolicy: &orphan})
		}
		c.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	}
	begin := time.Now()
	if n.procs["kubelet"] != nil {
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(250 * time.Millisecond) {
			left := podsLeft(c)
			if len(left) == 0 {
				break
			}
			if time.Now().After(deadline) {
				n.t.Errorf("teardown: pods not deleted by the kubelet after 60 s: %v", left)
				break
			}
		}
	}
	n.t.Logf("teardown: pods deleted in %v", time.Since(begin).Round(time.Millisecond))
	n.Stop("kubelet")
	n.Stop("containerd")
	killMountNamespace(n.Pid())
	killCgroups(n.cgroupRoot)
}

// podsLeft names the pods the API server still has.
func podsLeft(c kubernetes.Interface) []string {
	pods, err := c.CoreV1().Pods(corev1.NamespaceAll).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return []string{err.Error()}
	}
	var names []string
	for _, p := range pods.Items {
		names = append(names, p.Namespace+"/"+p.Name)
	}
	return names
}

// killMountNamespace kills every process in anchor's mount namespace but
// the anchor (the shims; containers have mount namespaces of their own).
func killMountNamespace(anchor int) {
	mnt, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", anchor))
	if err != nil {
		return
	}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		pid, _ := strconv.Atoi(filepath.Base(p))
		if ns, _ := os.Readlink(p + "/ns/mnt"); ns == mnt && pid != anchor {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// makeCgroups creates the cgroup top in every hierarchy (the kubelet
// refuses a cgroupRoot that does not exist); a cpuset gets its parent's
// CPUs and memory nodes, without which no task may join it.
func makeCgroups(top string) error {
	hierarchies, _ := filepath.Glob("/sys/fs/cgroup/*/cgroup.procs")
	for _, procs := range hierarchies {
		parent := filepath.Dir(procs)
		d := filepath.Join(parent, top)
		if err := os.Mkdir(d, 0o755); err != nil && !os.IsExist(err) {
			return fmt.Errorf("cgroup %s: %w", d, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if v, err := os.ReadFile(filepath.Join(parent, f)); err == nil {
				if err := os.WriteFile(filepath.Join(d, f), v, 0o644); err != nil {
					return fmt.Errorf("cgroup %s: %w", filepath.Join(d, f), err)
				}
			}
		}
	}
	return nil
}

// killCgroups kills what is left in the cgroup top of every hierarchy and
// removes its tree, deepest first.
func killCgroups(top string) {
	hierarchies, _ := filepath.Glob("/sys/fs/cgroup/*/" + top)
	for _, root := range hierarchies {
		var dirs []string
		filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for _, d := range dirs {
			procs, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, f := range bytes.Fields(procs) {
				if pid, err := strconv.Atoi(string(f)); err == nil {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		for i := len(dirs) - 1; i >= 0; i-- {
			for try := 0; try < 50; try++ {
				if err := os.Remove(dirs[i]); err == nil || os.IsNotExist(err) {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
}
