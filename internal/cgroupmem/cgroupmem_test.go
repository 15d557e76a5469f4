package cgroupmem

import (
	"os"
	"path/filepath"
	"testing"
)

func write(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestRead(t *testing.T) {
	for _, c := range []struct {
		name   string
		proc   string
		files  map[string]string
		bytes  int64
		file   string
		hasErr bool
	}{{
		name: "v2, own limit", proc: "0::/kubepods/pod1/agent\n",
		files: map[string]string{"cgroup.controllers": "memory", "kubepods/memory.max": "max", "kubepods/pod1/memory.max": "1073741824",
			"kubepods/pod1/agent/memory.max": "536870912"},
		bytes: 512 << 20, file: "kubepods/pod1/agent/memory.max",
	}, {
		name: "v2, a parent's limit is smaller", proc: "0::/kubepods/pod1/agent\n",
		files: map[string]string{"cgroup.controllers": "memory", "kubepods/pod1/memory.max": "268435456",
			"kubepods/pod1/agent/memory.max": "max"},
		bytes: 256 << 20, file: "kubepods/pod1/memory.max",
	}, {
		name: "v2, no limit", proc: "0::/a\n",
		files: map[string]string{"cgroup.controllers": "memory", "a/memory.max": "max"},
		file:  "a/memory.max",
	}, {
		name: "v2 in a cgroup namespace", proc: "0::/\n",
		files: map[string]string{"cgroup.controllers": "memory", "memory.max": "134217728"},
		bytes: 128 << 20, file: "memory.max",
	}, {
		name: "hybrid: memory on v1", proc: "4:memory:/process_api/x/agent\n0::/\n",
		files: map[string]string{"unified/cgroup.controllers": "", "memory/memory.limit_in_bytes": "9223372036854771712",
			"memory/process_api/x/memory.limit_in_bytes":       "9223372036854771712",
			"memory/process_api/x/agent/memory.limit_in_bytes": "402653184"},
		bytes: 384 << 20, file: "memory/process_api/x/agent/memory.limit_in_bytes",
	}, {
		name: "v1 container mount is its own cgroup", proc: "9:cpuset:/\n5:memory,blah:/docker/abc\n",
		files: map[string]string{"memory/memory.limit_in_bytes": "536870912"},
		bytes: 512 << 20, file: "memory/memory.limit_in_bytes",
	}, {
		name: "bad value", proc: "0::/a\n",
		files:  map[string]string{"cgroup.controllers": "memory", "a/memory.max": "lots"},
		hasErr: true,
	}, {
		name: "no memory controller", proc: "1:cpu:/\n", hasErr: true,
	}} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			root := filepath.Join(dir, "cgroup")
			write(t, filepath.Join(dir, "proc"), c.proc)
			for p, v := range c.files {
				write(t, filepath.Join(root, p), v)
			}
			os.MkdirAll(root, 0o755)
			l, err := Read(filepath.Join(dir, "proc"), root)
			if c.hasErr {
				if err == nil {
					t.Fatalf("no error, got %+v", l)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if l.Bytes != c.bytes || l.File != filepath.Join(root, c.file) {
				t.Errorf("got %d %s, want %d %s", l.Bytes, l.File, c.bytes, filepath.Join(root, c.file))
			}
		})
	}
}
