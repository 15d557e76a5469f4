// Package privtest holds helpers for tests that need root: they check the
// privilege once, with a clear message, and set up private kernel objects
// (a BPF filesystem in a temporary directory) that are removed even when
// the test fails.
package privtest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// Require skips t when not running as root. Under CI (CI set in the
// environment) it fails instead, so a privileged test is never silently
// skipped where it must run.
func Require(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		if err := rlimit.RemoveMemlock(); err != nil {
			t.Fatalf("remove memlock rlimit: %v", err)
		}
		return
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("this test needs root (BPF maps, bpffs mounts) and CI must run it as root")
	}
	t.Skip("needs root: BPF maps and a private bpffs mount; run as root (make test does)")
}

// MountBPFFS mounts a private BPF filesystem in a new temporary directory
// and detaches it when the test ends.
func MountBPFFS(t testing.TB) string {
	t.Helper()
	Require(t)
	dir := filepath.Join(t.TempDir(), "bpffs")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		t.Fatalf("mount bpffs on %s: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount bpffs %s: %v", dir, err)
		}
	})
	return dir
}
