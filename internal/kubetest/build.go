package kubetest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Version is the Kubernetes release the tests run against: the version the
// tools/kube-apiserver module requires.
const Version = "v1.37.2"

// APIServerBinary returns the path of kube-apiserver Version, building it
// from tools/kube-apiserver into the user's cache directory the first time
// (about 5 minutes on 2 cores). Concurrent test binaries wait for one build
// under a file lock instead of building it twice.
func APIServerBinary() (string, error) {
	dir, unlock, err := lockedCacheDir("kube-apiserver-" + Version)
	if err != nil {
		return "", err
	}
	defer unlock()
	bin := filepath.Join(dir, "kube-apiserver")
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	module, err := toolsModule()
	if err != nil {
		return "", err
	}
	tmp := bin + ".tmp"
	build := exec.Command("go", "build", "-o", tmp, "k8s.io/kubernetes/cmd/kube-apiserver")
	build.Dir = module
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build kube-apiserver %s in %s: %w\n%s", Version, module, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", fmt.Errorf("install kube-apiserver: %w", err)
	}
	return bin, nil
}

// NodeBinaries are the Kubernetes programs of a node and its control plane
// besides the API server: the paths of kubelet, kube-scheduler and
// kube-controller-manager Version.
type NodeBinaries struct {
	Kubelet, Scheduler, ControllerManager string
}

// NodeBinariesBuilt returns kubelet, kube-scheduler and
// kube-controller-manager Version, building them from tools/kube-apiserver
// into the user's cache directory the first time (one go build for the
// three, about 7 minutes on 2 cores), with their version stamped as a
// release build's is: the kubelet reports it on its Node and the API
// server compares it. Concurrent test binaries wait for one build.
func NodeBinariesBuilt() (NodeBinaries, error) {
	dir, unlock, err := lockedCacheDir("kubernetes-node-" + Version)
	if err != nil {
		return NodeBinaries{}, err
	}
	defer unlock()
	bins := NodeBinaries{
		Kubelet:           filepath.Join(dir, "kubelet"),
		Scheduler:         filepath.Join(dir, "kube-scheduler"),
		ControllerManager: filepath.Join(dir, "kube-controller-manager"),
	}
	missing := false
	for _, b := range []string{bins.Kubelet, bins.Scheduler, bins.ControllerManager} {
		if _, err := os.Stat(b); err != nil {
			missing = true
		}
	}
	if !missing {
		return bins, nil
	}
	module, err := toolsModule()
	if err != nil {
		return NodeBinaries{}, err
	}
	tmp := filepath.Join(dir, "build")
	if err := os.RemoveAll(tmp); err != nil {
		return NodeBinaries{}, err
	}
	build := exec.Command("go", "build", "-ldflags", versionLDFlags(), "-o", tmp+"/",
		"k8s.io/kubernetes/cmd/kubelet", "k8s.io/kubernetes/cmd/kube-scheduler", "k8s.io/kubernetes/cmd/kube-controller-manager")
	build.Dir = module
	if out, err := build.CombinedOutput(); err != nil {
		return NodeBinaries{}, fmt.Errorf("build kubelet, kube-scheduler, kube-controller-manager %s in %s: %w\n%s", Version, module, err, out)
	}
	for _, b := range []string{bins.Kubelet, bins.Scheduler, bins.ControllerManager} {
		if err := os.Rename(filepath.Join(tmp, filepath.Base(b)), b); err != nil {
			return NodeBinaries{}, fmt.Errorf("install %s: %w", filepath.Base(b), err)
		}
	}
	return bins, os.Remove(tmp)
}

// versionLDFlags stamp Version into component-base, as Kubernetes' release
// builds do; a plain go build reports v0.0.0-master.
func versionLDFlags() string {
	major, rest, _ := strings.Cut(strings.TrimPrefix(Version, "v"), ".")
	minor, _, _ := strings.Cut(rest, ".")
	const v = "k8s.io/component-base/version."
	return fmt.Sprintf("-X %sgitVersion=%s -X %sgitMajor=%s -X %sgitMinor=%s",
		v, Version, v, major, v, minor)
}

// lockedCacheDir creates <user cache>/ipmasq/name and holds its build lock
// until unlock is called.
func lockedCacheDir(name string) (dir string, unlock func(), err error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", nil, fmt.Errorf("find a cache directory for %s: %w", name, err)
	}
	dir = filepath.Join(cache, "ipmasq", name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", nil, fmt.Errorf("create %s: %w", dir, err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", nil, fmt.Errorf("open build lock: %w", err)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		lock.Close()
		return "", nil, fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	return dir, func() { unix.Flock(int(lock.Fd()), unix.LOCK_UN); lock.Close() }, nil
}

// toolsModule finds tools/kube-apiserver from the repository's go.mod.
func toolsModule() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("not inside the ipmasq module: cannot find tools/kube-apiserver")
	}
	dir := filepath.Join(filepath.Dir(gomod), "tools", "kube-apiserver")
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		return "", fmt.Errorf("tools module for kube-apiserver: %w", err)
	}
	return dir, nil
}
