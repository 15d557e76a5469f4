// Package toolbuild builds the programs the tests need from the separate
// Go modules under tools/ (kube-apiserver, promtool) into the user's cache
// directory, once: the product's go.mod does not carry their modules.
package toolbuild

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Binary returns <cache>/ipmasq/<name>-<version>/<name>, building pkg in
// the module tools/<tool> the first time, with go build's flags (e.g.
// -ldflags). Concurrent test binaries wait for one build under a file lock
// instead of building it twice.
func Binary(tool, name, version, pkg string, flags ...string) (string, error) {
	return BinaryEnv(nil, tool, name, version, pkg, flags...)
}

// BinaryEnv is Binary with env added to go build's environment (e.g.
// CGO_ENABLED=0 for a binary that goes into an image without a C library).
func BinaryEnv(env []string, tool, name, version, pkg string, flags ...string) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find a cache directory for %s: %w", name, err)
	}
	dir := filepath.Join(cache, "ipmasq", name+"-"+version)
	bin := filepath.Join(dir, name)
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
	module, err := Module(tool)
	if err != nil {
		return "", err
	}
	tmp := bin + ".tmp"
	build := exec.Command("go", append(append([]string{"build"}, flags...), "-o", tmp, pkg)...)
	build.Dir = module
	build.Env = append(os.Environ(), env...)
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build %s %s in %s: %w\n%s", name, version, module, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", fmt.Errorf("install %s: %w", name, err)
	}
	return bin, nil
}

// Module finds tools/<tool> from the repository's go.mod.
func Module(tool string) (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("not inside the ipmasq module: cannot find tools/%s", tool)
	}
	dir := filepath.Join(filepath.Dir(gomod), "tools", tool)
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		return "", fmt.Errorf("tools module for %s: %w", tool, err)
	}
	return dir, nil
}
