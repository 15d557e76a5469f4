// Command ipmasq-demo shows ipmasq masquerading real traffic. It builds a
// small network of namespaces — a pod (10.244.1.2), a node (uplink
// 10.0.0.5) running ipmasq-agent, and an external host (10.0.0.2 and
// 203.0.113.10) that has no route to the pod CIDR — sends traffic from the
// pod, and prints the source address the external host saw while the
// config changes. It also allocates a pod address over the agent's API and
// shows the pod's ip rules following the config, feeds the agent a bad
// file, and restarts it under a running TCP stream.
//
// It needs root (namespaces, a private bpffs, BPF programs) and touches
// nothing of the host's network: everything lives in namespaces and a
// temporary directory that it removes.
//
//	go build -o bin/ ./cmd/...
//	bin/ipmasq-demo --agent bin/ipmasq-agent [--tc-attach-mode=clsact]
//
// It waits for what the agent reports over its shell socket (its status
// names the devices the datapath is attached to), so it works in either
// attach mode; when the agent fails, it prints the end of the agent's log.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/readers/shell"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

const port = 8080

func main() {
	agentBin := flag.String("agent", "bin/ipmasq-agent", "path of the ipmasq-agent binary")
	attachMode := flag.String("tc-attach-mode", "auto", "the agent's --tc-attach-mode: auto, tcx or clsact")
	timeout := flag.Duration("timeout", 60*time.Second, "how long to wait for each thing the agent does (start, config change)")
	flag.Parse()
	switch *attachMode {
	case "auto", "tcx", "clsact":
	default:
		fmt.Fprintf(os.Stderr, "demo: --tc-attach-mode=%q: want auto, tcx or clsact\n", *attachMode)
		os.Exit(2)
	}
	if *timeout <= 0 {
		fmt.Fprintf(os.Stderr, "demo: --timeout=%v: want a positive duration\n", *timeout)
		os.Exit(2)
	}
	waitTimeout = *timeout
	if err := run(*agentBin, *attachMode); err != nil {
		fmt.Fprintf(os.Stderr, "demo: %v\n", err)
		os.Exit(1)
	}
}

// waitTimeout bounds each wait for the agent (--timeout): under an
// emulated CPU (the kernel matrix's qemu guests) loading the programs takes
// several seconds.
var waitTimeout = 60 * time.Second

type demo struct {
	topo       *topology.Masquerade
	agentBin   string
	attachMode string
	dir        string
	bpfRoot    string
	configPath string
	logPath    string
	agent      *exec.Cmd
	// exited is closed when the running agent's process has ended, with
	// its Wait's error in exitErr.
	exited  chan struct{}
	exitErr error
}

func run(agentBin, attachMode string) error {
	if os.Geteuid() != 0 {
		return errors.New("needs root: it creates network namespaces, mounts a private bpffs and loads BPF programs (try: sudo make demo)")
	}
	dir, err := os.MkdirTemp("", "ipmasq-demo-")
	if err != nil {
		return err
	}
	d := &demo{
		agentBin:   agentBin,
		attachMode: attachMode,
		dir:        dir,
		bpfRoot:    filepath.Join(dir, "bpffs"),
		configPath: filepath.Join(dir, "config", "ip-masq-agent"),
		logPath:    filepath.Join(dir, "agent.log"),
	}
	defer d.cleanup()
	if err := d.run(); err != nil {
		// The log goes with the temporary directory: its end, which says
		// why the agent did not do what the demo waited for, first.
		if tail := d.logTail(30); tail != "" {
			return fmt.Errorf("%w\nthe agent log's last lines (%s):\n%s", err, d.logPath, tail)
		}
		return err
	}
	return nil
}

func (d *demo) run() error {
	var err error
	if err := os.MkdirAll(d.bpfRoot, 0o700); err != nil {
		return err
	}
	if err := unix.Mount("bpf", d.bpfRoot, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount private bpffs: %w", err)
	}
	if d.topo, err = topology.NewMasquerade(); err != nil {
		return err
	}
	if _, err := topology.ServeSource(d.topo.Ext, port); err != nil {
		return err
	}

	step("1. The network (namespaces): pod 10.244.1.2 ─ node (eth0 10.0.0.5, runs ipmasq-agent) ─ ext (10.0.0.2, 203.0.113.10)")
	fmt.Println("   ext has no route to the pod CIDR 10.244.1.0/24: a pod's packets get answers only when masqueraded.")
	first := "nonMasqueradeCIDRs: [172.16.0.0/12, 192.168.0.0/16]\nmasqLinkLocal: false\nresyncInterval: 60s\n"
	if err := d.writeConfig(first); err != nil {
		return err
	}
	fmt.Print(indent("$ cat ip-masq-agent\n" + first))
	if err := d.startAgent(); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "172.16.0.0/12") }); err != nil {
		return err
	}
	if err := d.showSources(topology.ExtIP4, topology.RemoteIP4, topology.RemoteIP6); err != nil {
		return err
	}

	step("2. Config change: 10.0.0.0/24 is a non-masquerade destination (and ext now routes the pod CIDR back)")
	if err := d.topo.RouteBack(); err != nil {
		return err
	}
	second := "nonMasqueradeCIDRs: [172.16.0.0/12, 192.168.0.0/16, 10.0.0.0/24]\nmasqLinkLocal: false\n"
	start := time.Now()
	if err := d.writeConfig(second); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "10.0.0.0/24") }); err != nil {
		return err
	}
	fmt.Printf("   (file written → maps updated in %s)\n", time.Since(start).Round(time.Millisecond))
	if err := d.showSources(topology.ExtIP4, topology.RemoteIP4); err != nil {
		return err
	}

	step("3. An exception: masqueradeCIDRs: [10.0.0.2/32] inside the non-masquerade range")
	third := second + "masqueradeCIDRs: [10.0.0.2/32]\n"
	if err := d.writeConfig(third); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "10.0.0.2/32 masquerade") }); err != nil {
		return err
	}
	if err := d.showSources(topology.ExtIP4); err != nil {
		return err
	}

	step("4. A pod address from the agent's IPAM API; its ip rules follow the config")
	if err := d.ipamAndRules(); err != nil {
		return err
	}

	step("5. A bad file is rejected; the last good config stays in force")
	if err := d.writeConfig("nonMasqueradeCIDRs: [10.0.0.1/8]\n"); err != nil {
		return err
	}
	line, err := d.waitLog("Config file rejected")
	if err != nil {
		return err
	}
	fmt.Println("   agent log: " + line)
	if err := d.showSources(topology.ExtIP4); err != nil {
		return err
	}
	// The good file back: an agent started on a file it rejects has no
	// config and attaches nothing (it is not Ready) until one loads.
	applied := d.countLog(`msg="Config applied"`)
	if err := d.writeConfig(third); err != nil {
		return err
	}
	if err := d.waitFor("the agent to apply the good file again", func() bool { return d.countLog(`msg="Config applied"`) > applied }); err != nil {
		return err
	}
	fmt.Println("   The good file back: applied again.")

	step("6. The agent is killed (SIGKILL) and restarted under a running TCP stream")
	if err := d.restartUnderStream(); err != nil {
		return err
	}

	step("7. Datapath counters")
	if err := d.showCounters(); err != nil {
		return err
	}
	if err := d.stopAgent(syscall.SIGTERM); err != nil {
		return err
	}
	fmt.Println("\nDemo done; namespaces, bpffs and files removed.")
	return nil
}

func step(title string) { fmt.Printf("\n== %s\n", title) }

func indent(s string) string {
	return "   " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n   ") + "\n"
}

// showSources connects from the pod to each destination and prints the
// source address the server there saw.
func (d *demo) showSources(dsts ...netip.Addr) error {
	for _, dst := range dsts {
		seen, err := topology.SeenSource(d.topo.Pod, netip.AddrPortFrom(dst, port))
		if err != nil {
			return fmt.Errorf("pod → %s: %w", dst, err)
		}
		what := "masqueraded to the node's address"
		if seen == topology.PodIP4.String() || seen == topology.PodIP6.String() {
			what = "the pod's own address"
		}
		fmt.Printf("   pod → %-15s TCP: the server saw %-12s (%s)\n", dst, seen, what)
	}
	return nil
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

// startAgent runs the agent in the node namespace and waits until its
// programs are attached to the uplink.
func (d *demo) startAgent() error {
	// The log is appended across restarts: this start is done when it holds
	// one more "Started hive" than now.
	started := d.countLog(`msg="Started hive"`)
	logFile, err := os.OpenFile(d.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logFile.Close()
	d.agent = exec.Command(d.agentBin, "--tc-attach-mode="+d.attachMode,
		"--bpf-root="+d.bpfRoot,
		"--ip-masq-agent-config-path="+d.configPath,
		"--state-dir="+filepath.Join(d.dir, "state"),
		"--api-socket="+filepath.Join(d.dir, "api.sock"),
		"--shell-sock-path="+filepath.Join(d.dir, "shell.sock"),
		"--pod-cidr="+topology.PodCIDR4, "--pod-cidr="+topology.PodCIDR6, "--enable-ipv6")
	d.agent.Stdout, d.agent.Stderr = logFile, logFile
	if err := d.topo.Node.Start(d.agent); err != nil {
		return fmt.Errorf("start %s: %w", d.agentBin, err)
	}
	agent, exited := d.agent, make(chan struct{})
	d.exited = exited
	go func() {
		d.exitErr = agent.Wait()
		close(exited)
	}()
	fmt.Printf("   $ ipmasq-agent --tc-attach-mode=%s --pod-cidr=%s --pod-cidr=%s --enable-ipv6 ...   (in the node namespace)\n", d.attachMode, topology.PodCIDR4, topology.PodCIDR6)
	// The agent handles SIGTERM only once its hive has started; its shell
	// answers from then on.
	if err := d.waitFor("the agent to start", func() bool { return d.countLog(`msg="Started hive"`) > started }); err != nil {
		return err
	}
	// What the agent reports, in either attach mode: its status names the
	// devices the datapath is attached to and how their attachment went.
	var status string
	err = d.waitFor("the agent to report the datapath attached to eth0", func() bool {
		status = d.agentStatus()
		return attachedLine(status, "eth0")
	})
	if err != nil {
		if line := datapathLine(status); line != "" {
			return fmt.Errorf("%w; the agent's status: %s", err, line)
		}
		return err
	}
	fmt.Println("   " + datapathLine(status))
	return nil
}

// agentStatus is `ipmasq-agent status`, asked over the agent's shell
// socket; "" when it does not answer.
func (d *demo) agentStatus() string {
	var b strings.Builder
	if err := shell.Run(filepath.Join(d.dir, "shell.sock"), &b, "ipmasq/status"); err != nil {
		return ""
	}
	return b.String()
}

// datapathLine is the status's "Datapath:" line, trimmed.
func datapathLine(status string) string {
	for _, l := range strings.Split(status, "\n") {
		if strings.HasPrefix(l, "Datapath:") {
			return strings.Join(strings.Fields(l), " ")
		}
	}
	return ""
}

// attachedLine says whether the status reports dev attached (its
// attachment reconciled: "eth0 [Done]").
func attachedLine(status, dev string) bool {
	line := datapathLine(status)
	return strings.Contains(line, " "+dev+" [Done]")
}

// logTail is the agent log's last n lines ("" without a log).
func (d *demo) logTail(n int) string {
	data, err := os.ReadFile(d.logPath)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return indent(strings.Join(lines, "\n"))
}

// countLog counts the agent log lines containing s.
func (d *demo) countLog(s string) int {
	data, err := os.ReadFile(d.logPath)
	if err != nil {
		return 0
	}
	return strings.Count(string(data), s)
}

func (d *demo) stopAgent(sig syscall.Signal) error {
	if d.agent == nil {
		return nil
	}
	_ = d.agent.Process.Signal(sig)
	<-d.exited
	d.agent = nil
	if sig == syscall.SIGTERM && d.exitErr != nil {
		return fmt.Errorf("agent exited with %v", d.exitErr)
	}
	return nil
}

func (d *demo) pinDir() string {
	cfg := settings.Default
	cfg.BPFRoot = d.bpfRoot
	return cfg.PinDir()
}

// waitMaps waits until the pinned maps satisfy ok, then prints them.
func (d *demo) waitMaps(ok func(string) bool) error {
	var out string
	err := d.waitFor("the maps to hold the config", func() bool {
		var err error
		out, err = nonmasqmaps.Format(bpf.Pinned{Dir: d.pinDir()})
		return err == nil && ok(out)
	})
	if err == nil {
		fmt.Print(indent("$ ipmasq-agent maps\n" + out))
	}
	return err
}

func (d *demo) ipamAndRules() error {
	client := ipamapi.NewClient(filepath.Join(d.dir, "api.sock"))
	rt := uint32(11)
	a, err := client.Allocate(context.Background(), ipamapi.AllocationRequest{Owner: "demo-pod/eth0", Family: "ipv4", RouteTable: &rt})
	if err != nil {
		return err
	}
	fmt.Printf("   POST /v1/ipam/allocations → %s, route table %d, nonMasqueradeCIDRs %v\n", a.IP, a.RouteTable, a.NonMasqueradeCIDRs)
	// The pool's first address is the pods' gateway: here the node's own
	// address on pod0. Handing it out would give a pod the node's address.
	if gw := topology.NodePodSideIP4; a.IP == gw {
		return fmt.Errorf("IPAM handed out %s, the node's own address on the pod side (the gateway)", a.IP)
	}
	fmt.Printf("   (%s, the pool's first address, is the node's own address on pod0, the pods' gateway: reserved, never handed out)\n", topology.NodePodSideIP4)
	// 172.16/12, 192.168/16, 10.0.0.0/24, 169.254/16 → table 11; the
	// 10.0.0.2/32 exception → main, more preferred.
	if err := d.waitRules(5); err != nil {
		return err
	}
	fmt.Println("   Drop 192.168.0.0/16 from the config: exactly that rule goes.")
	if err := d.writeConfig("nonMasqueradeCIDRs: [172.16.0.0/12, 10.0.0.0/24]\nmasqueradeCIDRs: [10.0.0.2/32]\nmasqLinkLocal: false\n"); err != nil {
		return err
	}
	return d.waitRules(4)
}

// waitRules waits until the node namespace holds n rules of ipmasq's
// protocol, then prints them.
func (d *demo) waitRules(n int) error {
	var keys []tables.IPRuleKey
	err := d.waitFor(fmt.Sprintf("%d ip rules", n), func() bool {
		keys, _ = iprules.NewNetlinkTarget(d.topo.Node.NL).List()
		return len(keys) == n
	})
	if err == nil {
		fmt.Print(indent("$ ip rule   # in the node namespace, ipmasq's rules only\n" + iprules.Format(keys)))
	}
	return err
}

// restartUnderStream keeps a TCP stream from the pod to ext busy while the
// agent is killed and started again, and reports that it never stopped.
func (d *demo) restartUnderStream() error {
	c, seen, err := topology.DialSource(d.topo.Pod, netip.AddrPortFrom(topology.RemoteIP4, port))
	if err != nil {
		return err
	}
	defer c.Close()
	var echoed atomic.Int64
	done := make(chan error, 1)
	stop := make(chan struct{})
	go func() {
		buf, got := make([]byte, 4096), make([]byte, 4096)
		for {
			select {
			case <-stop:
				done <- nil
				return
			default:
			}
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Write(buf); err != nil {
				done <- err
				return
			}
			if _, err := io.ReadFull(c, got); err != nil {
				done <- err
				return
			}
			echoed.Add(int64(len(buf)))
		}
	}()
	time.Sleep(300 * time.Millisecond)
	before := echoed.Load()
	if err := d.stopAgent(syscall.SIGKILL); err != nil {
		return err
	}
	time.Sleep(300 * time.Millisecond)
	during := echoed.Load()
	if err := d.startAgent(); err != nil {
		return err
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	if err := <-done; err != nil {
		return fmt.Errorf("the stream broke: %w", err)
	}
	after := echoed.Load()
	fmt.Printf("   stream pod → 203.0.113.10 (server saw %s): %d KiB echoed before the kill, %d KiB while the agent was down, %d KiB after the restart\n",
		seen, before>>10, (during-before)>>10, (after-during)>>10)
	return nil
}

func (d *demo) showCounters() error {
	m, err := ebpf.LoadPinnedMap(filepath.Join(d.pinDir(), bpf.MapCounters), nil)
	if err != nil {
		return err
	}
	defer m.Close()
	vals, err := bpf.ReadCounters(m)
	if err != nil {
		return err
	}
	for i, v := range vals {
		if v != 0 {
			fmt.Printf("   %-32s %d\n", bpf.Counter(i), v)
		}
	}
	return nil
}

// waitFor polls cond for --timeout; it gives up at once when the agent
// has exited, with its exit status.
func (d *demo) waitFor(what string, cond func() bool) error {
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		if cond() {
			return nil
		}
		if d.exited != nil {
			select {
			case <-d.exited:
				return fmt.Errorf("waiting for %s: the agent exited (%v)", what, d.exitErr)
			default:
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("timed out after %v waiting for %s", waitTimeout, what)
}

// waitLog waits for a log line containing s and returns it.
func (d *demo) waitLog(s string) (string, error) {
	var found string
	err := d.waitFor(fmt.Sprintf("%q in the agent log", s), func() bool {
		f, err := os.Open(d.logPath)
		if err != nil {
			return false
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			if strings.Contains(sc.Text(), s) {
				found = sc.Text()
				return true
			}
		}
		return false
	})
	return found, err
}

func (d *demo) cleanup() {
	if d.agent != nil {
		_ = d.agent.Process.Kill()
		<-d.exited
	}
	if d.topo != nil {
		d.topo.Close()
	}
	_ = unix.Unmount(d.bpfRoot, unix.MNT_DETACH)
	_ = os.RemoveAll(d.dir)
}
