// Command ipmasq-demo shows the agent at work on a private BPF filesystem
// and in a network namespace of its own: it starts ipmasq-agent on a
// built-in config, prints the maps it wrote, changes the config, allocates
// a pod address over the API and shows the pod's ip rules following the
// config, feeds it a bad file, and restarts it. It needs root (bpffs mount,
// BPF maps, a network namespace) and touches nothing of the host but a
// temporary directory.
//
//	go build -o bin/ipmasq-agent ./cmd/ipmasq-agent
//	go run ./cmd/ipmasq-demo --agent bin/ipmasq-agent
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cells/agentconfig"
	"github.com/ipmasq/ipmasq/cells/api"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/tables"
)

const firstConfig = `# The example from the Kubernetes ip-masq-agent documentation, plus an
# exception: the service range inside 10.0.0.0/8 is masqueraded.
nonMasqueradeCIDRs:
  - 10.0.0.0/8
  - 172.16.0.0/12
  - 100.64.0.0/10
  - 192.168.0.0/16
masqueradeCIDRs:
  - 10.96.0.0/12
masqLinkLocal: false
resyncInterval: 60s
`

func main() {
	agentBin := flag.String("agent", "bin/ipmasq-agent", "path of the ipmasq-agent binary")
	flag.Parse()
	if err := run(*agentBin); err != nil {
		fmt.Fprintf(os.Stderr, "demo: %v\n", err)
		os.Exit(1)
	}
}

type demo struct {
	netns      netns.NsHandle
	nl         *netlink.Handle
	agentBin   string
	dir        string
	bpfRoot    string
	configPath string
	logPath    string
	agent      *exec.Cmd
}

func run(agentBin string) error {
	if os.Geteuid() != 0 {
		return errors.New("needs root: it mounts a private bpffs and creates BPF maps (try: sudo make demo)")
	}
	dir, err := os.MkdirTemp("", "ipmasq-demo-")
	if err != nil {
		return err
	}
	d := &demo{
		agentBin:   agentBin,
		dir:        dir,
		bpfRoot:    filepath.Join(dir, "bpffs"),
		configPath: filepath.Join(dir, "config", "ip-masq-agent"),
		logPath:    filepath.Join(dir, "agent.log"),
	}
	defer d.cleanup()
	if err := os.MkdirAll(d.bpfRoot, 0o700); err != nil {
		return err
	}
	if err := unix.Mount("bpf", d.bpfRoot, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount private bpffs: %w", err)
	}
	// The agent runs in a network namespace of its own, so the ip rules it
	// writes never reach the host's.
	if d.netns, err = newNetns(); err != nil {
		return err
	}
	if d.nl, err = netlink.NewHandleAt(d.netns); err != nil {
		return err
	}

	step("1. Config file (what an operator's ConfigMap holds)")
	if err := d.writeConfig(firstConfig); err != nil {
		return err
	}
	fmt.Print(indent(firstConfig))

	step("2. Start ipmasq-agent; the maps it pinned under " + filepath.Join(d.bpfRoot, "ipmasq"))
	if err := d.startAgent(); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "10.96.0.0/12 masquerade") }); err != nil {
		return err
	}

	step("3. Add 198.18.0.0/15 (editor-style save); the agent applies it within milliseconds")
	changed := strings.Replace(firstConfig, "  - 192.168.0.0/16\n", "  - 192.168.0.0/16\n  - 198.18.0.0/15\n", 1)
	start := time.Now()
	if err := d.writeConfig(changed); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "198.18.0.0/15") }); err != nil {
		return err
	}
	fmt.Printf("   (file written → maps updated in %s, measured by polling the map)\n", time.Since(start).Round(time.Millisecond))

	step("4. A pod gets an address over the API; its ip rules follow the config")
	client := api.NewClient(filepath.Join(d.dir, "api.sock"))
	rt := uint32(11)
	var alloc api.AllocationResponse
	if err := retry(func() (err error) {
		alloc, err = client.Allocate(context.Background(), api.AllocationRequest{Owner: "demo-pod/eth0", Family: "ipv4", RouteTable: &rt})
		return err
	}); err != nil {
		return err
	}
	fmt.Printf("   POST /v1/ipam/allocations → %s, route table %d, nonMasqueradeCIDRs %v\n", alloc.IP, alloc.RouteTable, alloc.NonMasqueradeCIDRs)
	if err := d.waitRules(7); err != nil {
		return err
	}
	fmt.Println("   Remove 198.18.0.0/15 again: the pod's rule for it goes, the others stay.")
	if err := d.writeConfig(firstConfig); err != nil {
		return err
	}
	if err := d.waitRules(6); err != nil {
		return err
	}

	step("5. A bad file (host bits set) is rejected; the maps keep the last good config")
	if err := d.writeConfig("nonMasqueradeCIDRs: [10.0.0.1/8]\n"); err != nil {
		return err
	}
	line, err := d.waitLog("Config file rejected")
	if err != nil {
		return err
	}
	fmt.Println("   agent log: " + line)
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "10.96.0.0/12") }); err != nil {
		return err
	}

	step("6. Stop the agent (SIGTERM): the maps stay pinned for the datapath")
	if err := d.stopAgent(); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "10.96.0.0/12") }); err != nil {
		return err
	}

	step("7. Delete the file and restart: the reserved-range defaults apply, and the pod's rules follow")
	if err := os.Remove(d.configPath); err != nil {
		return err
	}
	if err := d.startAgent(); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool {
		return strings.Contains(s, "240.0.0.0/4") && !strings.Contains(s, "10.96.0.0/12")
	}); err != nil {
		return err
	}
	if err := d.waitRules(12); err != nil {
		return err
	}
	if err := d.stopAgent(); err != nil {
		return err
	}
	fmt.Println("\nDemo done. The agent's log was", d.logPath, "(removed with the demo directory).")
	return nil
}

func step(title string) { fmt.Printf("\n== %s\n", title) }

func indent(s string) string {
	return "   " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n   ") + "\n"
}

// writeConfig replaces the config file atomically, as editors and the
// kubelet do.
func (d *demo) writeConfig(content string) error {
	if err := os.MkdirAll(filepath.Dir(d.configPath), 0o755); err != nil {
		return err
	}
	tmp := d.configPath + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, d.configPath)
}

func (d *demo) startAgent() error {
	logFile, err := os.OpenFile(d.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	// Everything the agent keeps lives in the demo directory.
	d.agent = exec.Command(d.agentBin,
		"--bpf-root="+d.bpfRoot,
		"--ip-masq-agent-config-path="+d.configPath,
		"--state-dir="+filepath.Join(d.dir, "state"),
		"--api-socket="+filepath.Join(d.dir, "api.sock"),
		"--pod-cidr=10.244.1.0/24")
	d.agent.Stdout, d.agent.Stderr = logFile, logFile
	if err := startIn(d.netns, d.agent); err != nil {
		logFile.Close()
		return fmt.Errorf("start %s: %w", d.agentBin, err)
	}
	logFile.Close()
	fmt.Printf("   $ %s\n", strings.Join(d.agent.Args, " "))
	return nil
}

func (d *demo) stopAgent() error {
	if d.agent == nil {
		return nil
	}
	_ = d.agent.Process.Signal(syscall.SIGTERM)
	err := d.agent.Wait()
	d.agent = nil
	if err != nil {
		return fmt.Errorf("agent exited with %v; log: %s", err, d.logPath)
	}
	fmt.Println("   agent stopped cleanly")
	return nil
}

// waitMaps polls the pinned maps until ok accepts their contents, then
// prints them.
func (d *demo) waitMaps(ok func(string) bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg := agentconfig.Default
	cfg.BPFRoot = d.bpfRoot
	last := ""
	for ctx.Err() == nil {
		if m, err := nonmasqmaps.LoadPinnedMaps(cfg.PinDir()); err == nil {
			out, err := m.Format()
			m.Close()
			if err == nil && ok(out) {
				fmt.Print(indent("$ ipmasq-agent maps --bpf-root=" + d.bpfRoot + "\n" + out))
				return nil
			}
			last = out
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("maps did not reach the expected state; last seen:\n%s\nagent log: %s", last, d.logPath)
}

// waitLog waits for a log line containing s and returns it.
func (d *demo) waitLog(s string) (string, error) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if f, err := os.Open(d.logPath); err == nil {
			sc := bufio.NewScanner(f)
			sc.Buffer(make([]byte, 1<<20), 1<<20)
			for sc.Scan() {
				if strings.Contains(sc.Text(), s) {
					f.Close()
					return sc.Text(), nil
				}
			}
			f.Close()
		}
		time.Sleep(10 * time.Millisecond)
	}
	return "", fmt.Errorf("no %q in the agent log %s", s, d.logPath)
}

// waitRules waits until the agent's network namespace holds n rules of
// ipmasq's protocol, then prints them.
func (d *demo) waitRules(n int) error {
	deadline := time.Now().Add(10 * time.Second)
	var keys []tables.IPRuleKey
	for time.Now().Before(deadline) {
		keys, _ = iprules.NewNetlinkTarget(d.nl).List()
		if len(keys) == n {
			fmt.Print(indent("$ ip rule   # in the agent's network namespace, ipmasq's rules only\n" + iprules.Format(keys)))
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return fmt.Errorf("want %d ip rules, have %d:\n%s", n, len(keys), iprules.Format(keys))
}

func retry(f func() error) error {
	var err error
	for range 100 {
		if err = f(); err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return err
}

// newNetns creates an unnamed network namespace without moving the caller.
func newNetns() (netns.NsHandle, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return 0, err
	}
	defer orig.Close()
	ns, err := netns.New()
	if err != nil {
		return 0, fmt.Errorf("create network namespace: %w", err)
	}
	if err := netns.Set(orig); err != nil {
		panic(err)
	}
	return ns, nil
}

// startIn starts cmd inside ns: the child inherits the namespace of the
// thread that forks it.
func startIn(ns netns.NsHandle, cmd *exec.Cmd) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		return err
	}
	startErr := cmd.Start()
	if err := netns.Set(orig); err != nil {
		panic(err)
	}
	return startErr
}

func (d *demo) cleanup() {
	if d.agent != nil {
		_ = d.agent.Process.Kill()
		_ = d.agent.Wait()
	}
	if d.nl != nil {
		d.nl.Close()
	}
	if d.netns != 0 {
		d.netns.Close()
	}
	_ = unix.Unmount(d.bpfRoot, unix.MNT_DETACH)
	_ = os.RemoveAll(d.dir)
}
