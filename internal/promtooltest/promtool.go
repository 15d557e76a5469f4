// Package promtooltest gives tests Prometheus' promtool, built from the
// tools/promtool module (a module of its own, so that the product's go.mod
// does not carry the Prometheus server) into the user's cache directory the
// first time, like internal/kubetest builds kube-apiserver.
package promtooltest

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Module is the Go module promtool is built from.
const Module = "github.com/prometheus/prometheus"

// Binary returns the path of promtool, building it from tools/promtool into
// <cache>/ipmasq/promtool-<version>/ the first time (a few minutes on 2
// cores). The version is the one tools/promtool/go.mod requires.
// Concurrent test binaries wait for one build under a file lock.
func Binary() (string, error) {
	module, err := toolsModule()
	if err != nil {
		return "", err
	}
	version, err := requiredVersion(filepath.Join(module, "go.mod"))
	if err != nil {
		return "", err
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find a cache directory for promtool: %w", err)
	}
	dir := filepath.Join(cache, "ipmasq", "promtool-"+version)
	bin := filepath.Join(dir, "promtool")
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
	tmp := bin + ".tmp"
	build := exec.Command("go", "build", "-o", tmp, Module+"/cmd/promtool")
	build.Dir = module
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build promtool %s in %s: %w\n%s", version, module, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", fmt.Errorf("install promtool: %w", err)
	}
	return bin, nil
}

// requiredVersion is the version of Module that go.mod requires.
func requiredVersion(gomod string) (string, error) {
	f, err := os.Open(gomod)
	if err != nil {
		return "", err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) >= 2 && fields[0] == Module && strings.HasPrefix(fields[1], "v") {
			return fields[1], nil
		}
	}
	return "", fmt.Errorf("%s requires no %s", gomod, Module)
}

// toolsModule finds tools/promtool from the repository's go.mod.
func toolsModule() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("not inside the ipmasq module: cannot find tools/promtool")
	}
	dir := filepath.Join(filepath.Dir(gomod), "tools", "promtool")
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		return "", fmt.Errorf("tools module for promtool: %w", err)
	}
	return dir, nil
}
