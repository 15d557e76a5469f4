// Package privtest holds helpers for tests that need root: they check the
// privilege once, with a clear message, and set up private kernel objects
// (a BPF filesystem in a temporary directory) that are removed even when
// the test fails.
package privtest

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Require fails t with a clear message when not running as root: the
// kernel tests are the point of the suite, so they are never skipped
// (a skipped test would hide a regression in CI or on a developer's node).
func Require(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatalf("needs root (BPF maps, private bpffs mounts, network namespaces): run the tests as root, e.g. sudo make test")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatalf("remove memlock rlimit: %v", err)
	}
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

// NetlinkHandleInNewNetns creates a network namespace for this test only
// and returns a netlink handle bound to it. The calling thread's namespace
// is restored at once; the namespace goes away when the test ends.
func NetlinkHandleInNewNetns(t testing.TB) *netlink.Handle {
	_, h := NewNetns(t)
	return h
}

// NewNetns creates a network namespace for this test only and returns it
// with a netlink handle bound to it. The calling thread's namespace is
// restored at once; the namespace goes away when the test ends.
func NewNetns(t testing.TB) (netns.NsHandle, *netlink.Handle) {
	t.Helper()
	Require(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatalf("get current netns: %v", err)
	}
	defer orig.Close()
	ns, err := netns.New()
	if err != nil {
		t.Fatalf("create netns: %v", err)
	}
	if err := netns.Set(orig); err != nil {
		// The thread is stuck in the new namespace; do not let it run
		// anything else.
		panic(fmt.Sprintf("restore netns: %v", err))
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		t.Fatalf("netlink handle in new netns: %v", err)
	}
	t.Cleanup(func() {
		h.Close()
		ns.Close()
	})
	return ns, h
}
