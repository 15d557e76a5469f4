package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCgroupMemoryLimit(t *testing.T) {
	root := t.TempDir()
	proc := filepath.Join(t.TempDir(), "cgroup")
	write := func(path, content string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	pod := "/kubepods.slice/kubepods-burstable.slice/cri-containerd-abc.scope"
	write(proc, "0::"+pod+"\n")

	// The DaemonSet's 256Mi limit.
	write(filepath.Join(root, pod, "memory.max"), "268435456\n")
	if got, err := cgroupMemoryLimit(proc, root); err != nil || got != 268435456 {
		t.Fatalf("limited cgroup: got %d, %v; want 268435456", got, err)
	}
	// No limit.
	write(filepath.Join(root, pod, "memory.max"), "max\n")
	if got, err := cgroupMemoryLimit(proc, root); err != nil || got != 0 {
		t.Fatalf("unlimited cgroup: got %d, %v; want 0", got, err)
	}
	// Garbage is an error, not a limit.
	write(filepath.Join(root, pod, "memory.max"), "lots\n")
	if _, err := cgroupMemoryLimit(proc, root); err == nil || !strings.Contains(err.Error(), `"lots"`) {
		t.Fatalf("bad memory.max: got %v, want an error naming the value", err)
	}
	// cgroup v1 only: no unified entry.
	write(proc, "12:memory:/docker/abc\n")
	if _, err := cgroupMemoryLimit(proc, root); err == nil {
		t.Fatal("cgroup v1 only: want an error")
	}
}
