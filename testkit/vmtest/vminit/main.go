// Command vminit is the init (PID 1) of the initramfs vmtest boots: a
// static binary that loads the kernel modules the initramfs carries (virtio,
// 9p, overlay), mounts the host's root filesystem (9p tag "hostroot",
// read-only) under a tmpfs overlay, binds the kernel package's own
// lib/modules over /lib/modules, mounts the results share (9p tag
// "results", writable) at its host path, switches root, runs the command
// the results share's spec.json names, writes its exit status to
// status.json there, and powers the machine off.
//
// Its parameters come from the kernel command line:
//
//	vmtest.results=<host path of the results directory>
//	vmtest.modules=<host path of the kernel's lib/modules/<release>>
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/testkit/vmtest"
)

const (
	lower   = "/lower"
	rw      = "/rw"
	newroot = "/newroot"
)

func main() {
	err := run()
	if err != nil {
		fmt.Fprintf(os.Stderr, "vminit: %v\n", err)
	}
	unix.Sync()
	if err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
		fmt.Fprintf(os.Stderr, "vminit: power off: %v\n", err)
	}
	select {}
}

func run() error {
	for _, m := range []struct{ src, dst, fstype, data string }{
		{"devtmpfs", "/dev", "devtmpfs", ""},
		{"proc", "/proc", "proc", ""},
		{"sysfs", "/sys", "sysfs", ""},
	} {
		if err := mount(m.src, m.dst, m.fstype, 0, m.data); err != nil {
			return err
		}
	}
	params, err := cmdline()
	if err != nil {
		return err
	}
	results, modules := params["vmtest.results"], params["vmtest.modules"]
	if results == "" || modules == "" {
		return fmt.Errorf("kernel command line lacks vmtest.results or vmtest.modules: %v", params)
	}
	if err := loadModules("/modules"); err != nil {
		return err
	}
	// 9p: a large msize makes fewer round trips through the emulated
	// virtqueue; cache=loose is right for a read-only lower layer.
	if err := mount("hostroot", lower, "9p", unix.MS_RDONLY, "trans=virtio,version=9p2000.L,msize=512000,cache=loose"); err != nil {
		return err
	}
	if err := mount("tmpfs", rw, "tmpfs", 0, "mode=0755"); err != nil {
		return err
	}
	for _, d := range []string{rw + "/upper", rw + "/work"} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	if err := mount("overlay", newroot, "overlay", 0, "lowerdir="+lower+",upperdir="+rw+"/upper,workdir="+rw+"/work"); err != nil {
		return err
	}
	for _, m := range []struct {
		src, dst, fstype string
		flags            uintptr
		data             string
	}{
		{"proc", "/proc", "proc", 0, ""},
		{"sysfs", "/sys", "sysfs", 0, ""},
		{"devtmpfs", "/dev", "devtmpfs", 0, ""},
		{"devpts", "/dev/pts", "devpts", 0, "newinstance,ptmxmode=0666"},
		{"tmpfs", "/dev/shm", "tmpfs", 0, ""},
		{"tmpfs", "/run", "tmpfs", 0, "mode=0755"},
		{"bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700"},
		{"cgroup2", "/sys/fs/cgroup", "cgroup2", 0, ""},
		{"debugfs", "/sys/kernel/debug", "debugfs", 0, ""},
		{"tracefs", "/sys/kernel/tracing", "tracefs", 0, ""},
	} {
		dst := newroot + m.dst
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
		if err := mount(m.src, dst, m.fstype, m.flags, m.data); err != nil {
			return err
		}
	}
	// The guest's /lib/modules is the kernel package's, so that modprobe
	// and the kernel's own module loading (veth, nf_nat, ...) find it.
	modDst := filepath.Join(newroot, "lib", "modules")
	if err := os.MkdirAll(modDst, 0o755); err != nil {
		return err
	}
	if err := mount(filepath.Dir(newroot+modules), modDst, "", unix.MS_BIND, ""); err != nil {
		return err
	}
	resDst := newroot + results
	if err := os.MkdirAll(resDst, 0o755); err != nil {
		return err
	}
	if err := mount("results", resDst, "9p", 0, "trans=virtio,version=9p2000.L,msize=512000"); err != nil {
		return err
	}
	if err := os.Chdir(newroot); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move %s to /: %w", newroot, err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	_ = unix.Sethostname([]byte("vmtest"))
	st := runSpec(results)
	b, _ := json.Marshal(st)
	if err := os.WriteFile(filepath.Join(results, "status.json"), b, 0o644); err != nil {
		return fmt.Errorf("write status: %w", err)
	}
	return nil
}

// runSpec runs spec.json's command with its output in results/output and
// reaps every orphan while it runs (this is PID 1).
func runSpec(results string) vmtest.Status {
	boot := uptime()
	st := vmtest.Status{ExitCode: -1, BootSeconds: boot}
	b, err := os.ReadFile(filepath.Join(results, "spec.json"))
	if err != nil {
		st.Error = err.Error()
		return st
	}
	var spec vmtest.Command
	if err := json.Unmarshal(b, &spec); err != nil {
		st.Error = fmt.Sprintf("spec.json: %v", err)
		return st
	}
	if len(spec.Argv) == 0 {
		st.Error = "spec.json: empty argv"
		return st
	}
	out, err := os.OpenFile(filepath.Join(results, "output"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		st.Error = err.Error()
		return st
	}
	defer out.Close()
	path := spec.Argv[0]
	if !strings.Contains(path, "/") {
		for _, e := range spec.Env {
			if p, ok := strings.CutPrefix(e, "PATH="); ok {
				os.Setenv("PATH", p)
			}
		}
		if path, err = exec.LookPath(path); err != nil {
			st.Error = err.Error()
			return st
		}
	}
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		st.Error = err.Error()
		return st
	}
	defer devnull.Close()
	start := time.Now()
	proc, err := os.StartProcess(path, spec.Argv, &os.ProcAttr{
		Dir:   spec.Dir,
		Env:   spec.Env,
		Files: []*os.File{devnull, out, out},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		st.Error = err.Error()
		return st
	}
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			st.Error = fmt.Sprintf("wait: %v", err)
			break
		}
		if pid != proc.Pid {
			continue
		}
		if ws.Signaled() {
			st.Signal = ws.Signal().String()
		} else {
			st.ExitCode = ws.ExitStatus()
		}
		break
	}
	st.RunSeconds = time.Since(start).Seconds()
	// The command's own children left behind are killed so that their
	// writes to the results share end before the power-off.
	_ = unix.Kill(-1, unix.SIGKILL)
	return st
}

func mount(src, dst, fstype string, flags uintptr, data string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(src, dst, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s (%s) on %s with %q: %w", src, fstype, dst, data, err)
	}
	return nil
}

func cmdline() (map[string]string, error) {
	b, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return nil, err
	}
	params := map[string]string{}
	for _, f := range strings.Fields(string(b)) {
		k, v, _ := strings.Cut(f, "=")
		params[k] = v
	}
	return params, nil
}

// loadModules loads dir's modules in the order of their names (the
// initramfs builder numbers them dependencies first). A .ko.xz goes to the
// kernel compressed: it decompresses it itself (MODULE_DECOMPRESS).
func loadModules(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	names := make([]string, 0, len(entries))
	for _, e := range entries {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	for _, n := range names {
		f, err := os.Open(filepath.Join(dir, n))
		if err != nil {
			return err
		}
		flags := 0
		if strings.HasSuffix(n, ".xz") || strings.HasSuffix(n, ".zst") || strings.HasSuffix(n, ".gz") {
			flags = unix.MODULE_INIT_COMPRESSED_FILE
		}
		err = unix.FinitModule(int(f.Fd()), "", flags)
		f.Close()
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("load module %s: %w", n, err)
		}
	}
	return nil
}

func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}

func uptime() float64 {
	b, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
