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
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find a cache directory for kube-apiserver: %w", err)
	}
	dir := filepath.Join(cache, "ipmasq", "kube-apiserver-"+Version)
	bin := filepath.Join(dir, "kube-apiserver")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("create %s: %w", dir, err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", fmt.Errorf("open build lock: %w", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)

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
