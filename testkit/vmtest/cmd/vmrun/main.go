// Command vmrun boots one of Debian's kernels under qemu (TCG) with the
// host's root filesystem read-only under a tmpfs overlay and runs a host
// command in the guest, printing its output; its exit status is the
// command's:
//
//	go test -c -o /tmp/bpf.test ./bpf/
//	go run ./testkit/vmtest/cmd/vmrun -kernel 6.1 -- /tmp/bpf.test -test.v -test.run TestLoad
//
// The kernel (5.10, 6.1 or 6.12) is fetched into the user's cache the first
// time (testkit/vmtest).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"time"

	"github.com/ipmasq/ipmasq/testkit/vmtest"
)

// envFlags collects -env KEY=VALUE.
type envFlags []string

func (e *envFlags) String() string { return strings.Join(*e, " ") }

func (e *envFlags) Set(v string) error {
	if !strings.Contains(v, "=") {
		return fmt.Errorf("-env %q: want KEY=VALUE", v)
	}
	*e = append(*e, v)
	return nil
}

func main() {
	kernel := flag.String("kernel", "6.1", "the guest's kernel: 5.10, 6.1 or 6.12")
	cpus := flag.Int("smp", 2, "the guest's CPUs")
	mem := flag.Int("m", 2048, "the guest's memory in MiB")
	dir := flag.String("dir", "", "the command's working directory in the guest (default: the current directory)")
	console := flag.String("console", "", "write the guest's serial console (kernel log) to this file")
	results := flag.String("results", "", "a host directory the guest may write to, mounted at the same path (default: a temporary one)")
	var env envFlags
	flag.Var(&env, "env", "KEY=VALUE added to the command's environment (repeatable); the guest's default is PATH (with Go), HOME=/root, TERM, LANG")
	timeout := flag.Duration("timeout", 30*time.Minute, "stop the guest after this long")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: vmrun [flags] -- command [args...]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	argv := flag.Args()
	if p, err := filepath.Abs(argv[0]); err == nil {
		if _, err := os.Stat(p); err == nil {
			argv[0] = p
		}
	}
	if *dir == "" {
		*dir, _ = os.Getwd()
	}
	k, err := vmtest.Fetch(*kernel)
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmrun:", err)
		os.Exit(1)
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt)
	defer cancel()
	ctx, cancel = context.WithTimeout(ctx, *timeout)
	defer cancel()
	r, err := vmtest.Run(ctx, vmtest.Options{
		Kernel: k, Argv: argv, Env: append(vmtest.DefaultEnv(), env...), Dir: *dir, CPUs: *cpus, MemoryMiB: *mem,
		Output: os.Stdout, Console: *console, ResultsDir: *results,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmrun:", err)
		os.Exit(1)
	}
	status := fmt.Sprintf("exit status %d", r.ExitCode)
	if r.Signal != "" {
		status = "killed by " + r.Signal
	}
	fmt.Fprintf(os.Stderr, "vmrun: kernel %s (%s): %s; boot %.1fs, command %.1fs, wall %s\n",
		k.Name, k.Release, status, r.BootSeconds, r.RunSeconds, r.Wall.Round(100*time.Millisecond))
	if r.ExitCode < 0 {
		os.Exit(1)
	}
	os.Exit(r.ExitCode)
}
