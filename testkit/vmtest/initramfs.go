package vmtest

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
)

// bootModules are the modules the init needs before it can mount the root:
// the virtio PCI transport, 9p over virtio, and overlayfs. Debian builds
// them as modules (6.12 builds virtio in); what is built in is left out.
var bootModules = []string{"virtio_pci", "9pnet_virtio", "9p", "overlay"}

// modulesInOrder resolves names against modules.dep and returns the module
// files (relative to the modules directory) in an order that loads each
// one's dependencies first. Names built into the kernel (modules.builtin)
// are left out.
func modulesInOrder(modules string, names []string) ([]string, error) {
	depFile := filepath.Join(modules, "modules.dep")
	f, err := os.Open(depFile)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	deps := map[string][]string{}
	byName := map[string]string{}
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		file, rest, ok := strings.Cut(s.Text(), ":")
		if !ok {
			continue
		}
		deps[file] = strings.Fields(rest)
		byName[moduleName(file)] = file
	}
	if err := s.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", depFile, err)
	}
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(modules, "modules.builtin")); err == nil {
		for _, l := range strings.Fields(string(b)) {
			builtin[moduleName(l)] = true
		}
	}
	var order []string
	seen := map[string]bool{}
	var visit func(file string)
	visit = func(file string) {
		if seen[file] {
			return
		}
		seen[file] = true
		d := deps[file]
		// modules.dep lists a module's dependencies with the ones it
		// needs directly first: load from the end.
		for i := len(d) - 1; i >= 0; i-- {
			visit(d[i])
		}
		order = append(order, file)
	}
	for _, n := range names {
		file, ok := byName[n]
		if !ok {
			if builtin[n] {
				continue
			}
			return nil, fmt.Errorf("module %s is neither in %s nor built in", n, depFile)
		}
		visit(file)
	}
	return order, nil
}

// moduleName is "9pnet_virtio" for "kernel/net/9p/9pnet_virtio.ko.xz".
func moduleName(file string) string {
	base := filepath.Base(file)
	if i := strings.Index(base, ".ko"); i >= 0 {
		base = base[:i]
	}
	return strings.ReplaceAll(base, "-", "_")
}

var (
	initOnce sync.Once
	initBin  []byte
	initErr  error
)

// initBinary builds vminit, static (CGO_ENABLED=0: the initramfs has no C
// library), once per process.
func initBinary() ([]byte, error) {
	initOnce.Do(func() {
		dir, err := os.MkdirTemp("", "vmtest-init-")
		if err != nil {
			initErr = err
			return
		}
		defer os.RemoveAll(dir)
		out := filepath.Join(dir, "init")
		src, err := initSource()
		if err != nil {
			initErr = err
			return
		}
		build := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, ".")
		build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
		build.Dir = src
		if b, err := build.CombinedOutput(); err != nil {
			initErr = fmt.Errorf("build vminit: %w\n%s", err, b)
			return
		}
		initBin, initErr = os.ReadFile(out)
	})
	return initBin, initErr
}

// initSource is vminit's source directory: next to this file's, so that
// vmrun started from any directory (another worktree's package, to run its
// test binary there) builds the init of the tree it was built from.
func initSource() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if ok && filepath.IsAbs(file) {
		dir := filepath.Join(filepath.Dir(file), "vminit")
		if _, err := os.Stat(filepath.Join(dir, "main.go")); err == nil {
			return dir, nil
		}
	}
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("find vminit's source: go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("find vminit's source: not built from source and not inside the ipmasq module")
	}
	return filepath.Join(filepath.Dir(gomod), "internal", "testkit", "vmtest", "vminit"), nil
}

// writeInitramfs writes the initramfs of k to path: an uncompressed newc
// cpio archive with /init (vminit), /dev/console, the mount points, and
// /modules/NN-<module> in load order.
func writeInitramfs(k *Kernel, path string) error {
	init, err := initBinary()
	if err != nil {
		return err
	}
	mods, err := modulesInOrder(k.Modules, bootModules)
	if err != nil {
		return fmt.Errorf("kernel %s: %w", k.Name, err)
	}
	var buf bytes.Buffer
	w := &cpioWriter{w: &buf}
	for _, d := range []string{"dev", "proc", "sys", "lower", "rw", "newroot", "modules"} {
		w.dir(d)
	}
	// The kernel opens /dev/console for init's standard streams before
	// devtmpfs is mounted.
	w.node("dev/console", 0o020600, 5, 1)
	w.file("init", 0o755, init)
	for i, m := range mods {
		b, err := os.ReadFile(filepath.Join(k.Modules, m))
		if err != nil {
			return err
		}
		w.file(fmt.Sprintf("modules/%02d-%s", i, filepath.Base(m)), 0o644, b)
	}
	w.trailer()
	if w.err != nil {
		return w.err
	}
	return os.WriteFile(path, buf.Bytes(), 0o644)
}

// cpioWriter writes the "newc" format the kernel's initramfs unpacker
// reads (Documentation/driver-api/early-userspace/buffer-format.rst).
type cpioWriter struct {
	w   io.Writer
	ino int
	err error
}

func (c *cpioWriter) header(name string, mode uint32, size int, rdevMajor, rdevMinor int) {
	if c.err != nil {
		return
	}
	c.ino++
	nlink := 1
	if mode&0o170000 == 0o040000 {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, nlink, 0, size, 0, 0, rdevMajor, rdevMinor, len(name)+1, 0)
	_, c.err = io.WriteString(c.w, hdr+name+"\x00")
	c.pad(len(hdr) + len(name) + 1)
}

func (c *cpioWriter) pad(n int) {
	if c.err != nil {
		return
	}
	if r := n % 4; r != 0 {
		_, c.err = c.w.Write(make([]byte, 4-r))
	}
}

func (c *cpioWriter) dir(name string) { c.header(name, 0o040755, 0, 0, 0) }

func (c *cpioWriter) node(name string, mode uint32, major, minor int) {
	c.header(name, mode, 0, major, minor)
}

func (c *cpioWriter) file(name string, perm uint32, data []byte) {
	c.header(name, 0o100000|perm, len(data), 0, 0)
	if c.err != nil {
		return
	}
	_, c.err = c.w.Write(data)
	c.pad(len(data))
}

func (c *cpioWriter) trailer() { c.header("TRAILER!!!", 0, 0, 0, 0) }
