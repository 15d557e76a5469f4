package vmtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Command is the command the guest runs (spec.json on the results share).
type Command struct {
	Argv []string `json:"argv"`
	Env  []string `json:"env"`
	Dir  string   `json:"dir"`
}

// Status is what the guest's init reports (status.json on the results
// share).
type Status struct {
	// ExitCode is the command's exit status (-1 when it was killed by a
	// signal or did not start).
	ExitCode int `json:"exit_code"`
	// Signal names the signal that ended the command, if one did.
	Signal string `json:"signal,omitempty"`
	// Error says why the command did not run or did not finish.
	Error string `json:"error,omitempty"`
	// BootSeconds is the guest's uptime when the command started: the
	// kernel's boot plus the init's module loads and mounts.
	BootSeconds float64 `json:"boot_seconds"`
	// RunSeconds is the command's run time in the guest.
	RunSeconds float64 `json:"run_seconds"`
}

// QEMU is the emulator: Debian package qemu-system-x86.
const QEMU = "qemu-system-x86_64"

// Options is one guest run.
type Options struct {
	// Kernel is the guest's kernel (Fetch).
	Kernel *Kernel
	// Argv is the command, a path the host and the guest share (the
	// host's root filesystem is the guest's, read-only under a tmpfs
	// overlay). A name without a slash is looked up in Env's PATH.
	Argv []string
	// Env is the command's environment; nil is DefaultEnv.
	Env []string
	// Dir is the command's working directory; "" is /.
	Dir string
	// CPUs and MemoryMiB size the guest: 2 and 2048 when zero.
	CPUs, MemoryMiB int
	// Output receives the command's standard output and error while it
	// runs; nil discards it.
	Output io.Writer
	// Console, when set, is the file the guest's serial console (the
	// kernel log) is written to; otherwise a temporary file that is
	// removed after the run.
	Console string
	// ResultsDir, when set, is the directory shared with the guest
	// writable (mounted at the same path in the guest): files the command
	// writes there are the host's after the run. Otherwise a temporary
	// directory, removed after the run.
	ResultsDir string
}

// Result is a finished guest run.
type Result struct {
	Status
	// Wall is the host's time from starting qemu to its exit.
	Wall time.Duration
	// ConsoleTail is the end of the serial console's output (the kernel
	// log), for the reason of a failed run.
	ConsoleTail string
}

// DefaultEnv is the guest command's environment when Options.Env is nil:
// root's, with Go on PATH.
func DefaultEnv() []string {
	return []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/local/go/bin",
		"HOME=/root",
		"TERM=dumb",
		"LANG=C.UTF-8",
	}
}

// Run boots o.Kernel under qemu-system-x86_64 with TCG and runs o.Argv in
// the guest. It returns an error when the guest does not report the
// command's status (qemu missing or failing, the init failing, ctx done);
// the command's own failure is a Result with a non-zero ExitCode.
func Run(ctx context.Context, o Options) (*Result, error) {
	if o.Kernel == nil || len(o.Argv) == 0 {
		return nil, errors.New("vmtest: Run needs a kernel and a command")
	}
	qemu, err := exec.LookPath(QEMU)
	if err != nil {
		return nil, fmt.Errorf("vmtest: %s is not installed (Debian package qemu-system-x86; tools/deps.sh installs it): %w", QEMU, err)
	}
	if o.CPUs == 0 {
		o.CPUs = 2
	}
	if o.MemoryMiB == 0 {
		o.MemoryMiB = 2048
	}
	if o.Env == nil {
		o.Env = DefaultEnv()
	}
	if o.Dir == "" {
		o.Dir = "/"
	}
	results := o.ResultsDir
	if results == "" {
		if results, err = os.MkdirTemp("", "vmtest-results-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(results)
	}
	if results, err = filepath.Abs(results); err != nil {
		return nil, err
	}
	for _, f := range []string{"status.json", "output"} {
		if err := os.Remove(filepath.Join(results, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
	}
	spec, err := json.Marshal(Command{Argv: o.Argv, Env: o.Env, Dir: o.Dir})
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(results, "spec.json"), spec, 0o644); err != nil {
		return nil, err
	}
	work, err := os.MkdirTemp("", "vmtest-boot-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	initrd := filepath.Join(work, "initramfs.cpio")
	if err := writeInitramfs(o.Kernel, initrd); err != nil {
		return nil, err
	}
	console := o.Console
	if console == "" {
		console = filepath.Join(work, "console.log")
	}
	append_ := strings.Join([]string{
		"console=ttyS0", "panic=-1", "quiet", "loglevel=4",
		// TCG emulates every mitigation's cost; the guest runs only tests.
		"mitigations=off",
		// The guest has no entropy device: trust -cpu max's RDRAND so
		// that getrandom does not block at boot (5.10).
		"random.trust_cpu=on",
		"no_timer_check",
		"rdinit=/init",
		"vmtest.results=" + results,
		"vmtest.modules=" + o.Kernel.Modules,
	}, " ")
	args := []string{
		"-accel", "tcg,thread=multi", "-cpu", "max",
		"-smp", strconv.Itoa(o.CPUs), "-m", strconv.Itoa(o.MemoryMiB),
		// No default devices: no network card (the guest sends nothing
		// outside itself), no graphics, no monitor.
		"-nodefaults", "-display", "none", "-no-reboot",
		"-serial", "file:" + console,
		// qboot (qemu's minimal firmware) and the uncompressed kernel's
		// PVH entry: the kernel prints its first line after about 2.5 s
		// instead of 14 (SeaBIOS and the bzImage's decompressor under TCG).
		"-bios", "qboot.rom",
		"-kernel", o.Kernel.Vmlinux, "-initrd", initrd, "-append", append_,
		"-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
		"-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
		"-fsdev", "local,id=results,path=" + results + ",security_model=none,multidevs=remap",
		"-device", "virtio-9p-pci,fsdev=results,mount_tag=results",
	}
	cmd := exec.CommandContext(ctx, qemu, args...)
	// The guest ends with the test that runs it, even when that is killed
	// (a test binary's timeout): no orphaned qemu keeps the cores. The
	// signal follows the thread that started qemu: kept until it ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var qemuOut strings.Builder
	cmd.Stdout, cmd.Stderr = &qemuOut, &qemuOut
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("vmtest: start %s: %w", QEMU, err)
	}
	done := make(chan struct{})
	tailed := make(chan struct{})
	go func() {
		defer close(tailed)
		tail(filepath.Join(results, "output"), o.Output, done)
	}()
	waitErr := cmd.Wait()
	close(done)
	<-tailed
	r := &Result{Wall: time.Since(start), ConsoleTail: fileTail(console, 4000)}
	b, err := os.ReadFile(filepath.Join(results, "status.json"))
	if err != nil {
		why := "the guest reported no status"
		if ctx.Err() != nil {
			why = fmt.Sprintf("the guest did not finish: %v", ctx.Err())
		}
		return r, fmt.Errorf("vmtest: kernel %s (%s): %s (qemu: %v %s); console's end:\n%s", o.Kernel.Name, o.Kernel.Release, why, waitErr, strings.TrimSpace(qemuOut.String()), r.ConsoleTail)
	}
	if err := json.Unmarshal(b, &r.Status); err != nil {
		return r, fmt.Errorf("vmtest: status.json: %w", err)
	}
	if r.Status.Error != "" {
		return r, fmt.Errorf("vmtest: kernel %s: the guest could not run %v: %s", o.Kernel.Name, o.Argv, r.Status.Error)
	}
	return r, nil
}

// tail copies what is appended to path to w until done is closed, then
// what is left.
func tail(path string, w io.Writer, done <-chan struct{}) {
	if w == nil {
		w = io.Discard
	}
	var f *os.File
	defer func() {
		if f != nil {
			f.Close()
		}
	}()
	for {
		finished := false
		select {
		case <-done:
			finished = true
		case <-time.After(200 * time.Millisecond):
		}
		if f == nil {
			f, _ = os.Open(path)
		}
		if f != nil {
			_, _ = io.Copy(w, f)
		}
		if finished {
			return
		}
	}
}

// fileTail is the last n bytes of path.
func fileTail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		_, _ = f.Seek(st.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	return string(b)
}
