// Package cgroupmem reads the memory limit of the process's own cgroup:
// cgroup v2's memory.max, or, where the memory controller is on a v1
// hierarchy, memory.limit_in_bytes. The limit in force is the smallest
// along the path from the process's cgroup up to the root, as the kernel
// enforces every ancestor's.
package cgroupmem

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Paths of the kernel's files, the defaults of Read.
const (
	ProcSelfCgroup = "/proc/self/cgroup"
	Root           = "/sys/fs/cgroup"
)

// v1Unlimited: a v1 limit at or above it means none (the kernel writes
// PAGE_COUNTER_MAX pages, 9223372036854771712 on 64-bit).
const v1Unlimited = 1 << 62

// Limit is a cgroup memory limit and where it was read.
type Limit struct {
	// Bytes is the limit; 0: none.
	Bytes int64
	// File is the file that set it (the smallest along the path), or the
	// process's own cgroup's when there is none.
	File string
}

// String says the limit and its file, for the log.
func (l Limit) String() string {
	if l.Bytes == 0 {
		return "no memory limit (" + l.File + ")"
	}
	return fmt.Sprintf("%d MiB (%s)", l.Bytes>>20, l.File)
}

// Read returns the memory limit of the process whose cgroup file is
// procCgroup, with the cgroup filesystems mounted under root (Root, or a
// test's copy): cgroup v2 (root itself or root/unified) when its memory
// controller is there, else the v1 memory hierarchy (root/memory).
func Read(procCgroup, root string) (Limit, error) {
	data, err := os.ReadFile(procCgroup)
	if err != nil {
		return Limit{}, err
	}
	var v2, v1 string
	hasV2, hasV1 := false, false
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	for sc.Scan() {
		// "hierarchy-ID:controller-list:cgroup-path"
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			v2, hasV2 = parts[2], true
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "memory" {
				v1, hasV1 = parts[2], true
			}
		}
	}
	if hasV1 {
		return walk(filepath.Join(root, "memory"), v1, "memory.limit_in_bytes", parseV1)
	}
	if hasV2 {
		for _, mount := range []string{root, filepath.Join(root, "unified")} {
			if _, err := os.Stat(filepath.Join(mount, "cgroup.controllers")); err == nil {
				return walk(mount, v2, "memory.max", parseV2)
			}
		}
	}
	return Limit{}, fmt.Errorf("%s names no cgroup with a memory controller under %s", procCgroup, root)
}

// walk returns the smallest limit of file from dir (under mount) up to
// mount. When dir is not under mount (a container's v1 mount is its own
// cgroup, without a cgroup namespace), mount itself is the process's
// cgroup.
func walk(mount, dir, file string, parse func(string) (int64, error)) (Limit, error) {
	start := filepath.Join(mount, filepath.Clean("/"+dir))
	if _, err := os.Stat(filepath.Join(start, file)); errors.Is(err, fs.ErrNotExist) {
		start = mount
	}
	lim := Limit{File: filepath.Join(start, file)}
	for d := start; ; d = filepath.Dir(d) {
		path := filepath.Join(d, file)
		raw, err := os.ReadFile(path)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			// the v2 root has no memory.max
		case err != nil:
			return Limit{}, err
		default:
			n, err := parse(string(raw))
			if err != nil {
				return Limit{}, fmt.Errorf("%s: %w", path, err)
			}
			if n > 0 && (lim.Bytes == 0 || n < lim.Bytes) {
				lim = Limit{Bytes: n, File: path}
			}
		}
		if d == mount || len(d) <= len(mount) {
			return lim, nil
		}
	}
}

// parseV2 reads memory.max: bytes, or "max" for none (0).
func parseV2(s string) (int64, error) {
	s = strings.TrimSpace(s)
	if s == "max" {
		return 0, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%q is not a byte count", s)
	}
	return n, nil
}

// parseV1 reads memory.limit_in_bytes: bytes, or a huge value for none (0).
func parseV1(s string) (int64, error) {
	s = strings.TrimSpace(s)
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a byte count", s)
	}
	if n >= v1Unlimited {
		return 0, nil
	}
	return int64(n), nil
}
