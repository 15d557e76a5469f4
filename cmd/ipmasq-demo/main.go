// Command ipmasq-demo shows the agent at work on a private BPF filesystem:
// it starts ipmasq-agent on a built-in config, prints the maps it wrote,
// changes the config, feeds it a bad file, and restarts it, printing the
// maps after each step. It needs root (bpffs mount, BPF maps) and touches
// nothing of the host but a temporary directory.
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
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cells/agentconfig"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
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

	step("4. A bad file (host bits set) is rejected; the maps keep the last good config")
	if err := d.writeConfig("nonMasqueradeCIDRs: [10.0.0.1/8]\n"); err != nil {
		return err
	}
	line, err := d.waitLog("Config file rejected")
	if err != nil {
		return err
	}
	fmt.Println("   agent log: " + line)
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "198.18.0.0/15") }); err != nil {
		return err
	}

	step("5. Stop the agent (SIGTERM): the maps stay pinned for the datapath")
	if err := d.stopAgent(); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "198.18.0.0/15") }); err != nil {
		return err
	}

	step("6. Delete the file and restart: the reserved-range defaults apply")
	if err := os.Remove(d.configPath); err != nil {
		return err
	}
	if err := d.startAgent(); err != nil {
		return err
	}
	if err := d.waitMaps(func(s string) bool { return strings.Contains(s, "240.0.0.0/4") }); err != nil {
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
	d.agent = exec.Command(d.agentBin,
		"--bpf-root="+d.bpfRoot,
		"--ip-masq-agent-config-path="+d.configPath)
	d.agent.Stdout, d.agent.Stderr = logFile, logFile
	if err := d.agent.Start(); err != nil {
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

func (d *demo) cleanup() {
	if d.agent != nil {
		_ = d.agent.Process.Kill()
		_ = d.agent.Wait()
	}
	_ = unix.Unmount(d.bpfRoot, unix.MNT_DETACH)
	_ = os.RemoveAll(d.dir)
}
