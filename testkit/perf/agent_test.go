package perf

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// buildAgent compiles ipmasq-agent once for the run.
func buildAgent(b *testing.B) string {
	b.Helper()
	bin := filepath.Join(b.TempDir(), "ipmasq-agent")
	build := exec.Command("go", "build", "-o", bin, "github.com/ipmasq/ipmasq/cmd/ipmasq-agent")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		b.Fatalf("build ipmasq-agent: %v", err)
	}
	return bin
}

// nonMasqCIDRs returns n distinct /24s in 100.64.0.0/10: none of them holds
// the destination (203.0.113.10), so every benchmark flow is masqueraded
// after the whole set has been consulted.
func nonMasqCIDRs(n int) []string {
	if n > 1<<14 {
		panic(fmt.Sprintf("%d /24s do not fit in 100.64.0.0/10", n))
	}
	base := netip.MustParseAddr("100.64.0.0").As4()
	out := make([]string, n)
	for i := range n {
		a := base
		a[1] += byte(i >> 8)
		a[2] = byte(i)
		out[i] = netip.PrefixFrom(netip.AddrFrom4(a), 24).String()
	}
	return out
}

// configCIDRs are the non-masquerade CIDRs of a condition with n: n /24s
// that miss the destination, and with -perf.unmasqueraded the
// destination's /24 too.
func configCIDRs(n int) []string {
	cidrs := nonMasqCIDRs(n)
	if *flagUnmasq {
		cidrs = append(cidrs, netip.PrefixFrom(topology.RemoteIP4, 24).Masked().String())
	}
	return cidrs
}

// runAgent starts ipmasq-agent in the node namespace with a private bpffs
// and a config of these non-masquerade CIDRs, and waits until its programs
// are attached to the uplink and the maps hold the whole config. It returns
// the pinned-map directory.
func runAgent(b *testing.B, bin string, node *topology.Netns, cidrs []string, natMaxEntries int) string {
	b.Helper()
	n := len(cidrs)
	dir := b.TempDir()
	bpfRoot := privtest.MountBPFFS(b)
	config := filepath.Join(dir, "config", "ip-masq-agent")
	data, err := json.Marshal(map[string]any{
		"nonMasqueradeCIDRs": cidrs,
		"masqLinkLocal":      false,
		"masqLinkLocalIPv6":  false,
	})
	if err != nil {
		b.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(config), 0o755); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(config, data, 0o644); err != nil {
		b.Fatal(err)
	}
	logPath := filepath.Join(dir, "agent.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		b.Fatal(err)
	}
	defer logFile.Close()
	cmd := exec.Command(bin,
		"--bpf-root="+bpfRoot,
		"--ip-masq-agent-config-path="+config,
		"--state-dir="+filepath.Join(dir, "state"),
		"--api-socket="+filepath.Join(dir, "api.sock"),
		"--shell-sock-path="+filepath.Join(dir, "shell.sock"),
		"--pod-cidr="+topology.PodCIDR4, "--pod-cidr="+topology.PodCIDR6,
		fmt.Sprintf("--nat-max-entries=%d", natMaxEntries),
		// The collector walks the whole NAT map with two syscalls per
		// entry; with three agents on two CPUs its bursts would land in
		// random rounds. This measures the datapath: see the doc.
		"--nat-gc-interval=1h")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := node.Start(cmd); err != nil {
		b.Fatalf("start agent: %v", err)
	}
	b.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()
		if b.Failed() {
			if data, err := os.ReadFile(logPath); err == nil {
				b.Logf("agent log (%d CIDRs):\n%s", n, tail(string(data), 40))
			}
		}
	})
	eth0, err := node.NL.LinkByName("eth0")
	if err != nil {
		b.Fatal(err)
	}
	pinDir := filepath.Join(bpfRoot, "ipmasq")
	waitFor(b, fmt.Sprintf("agent with %d CIDRs: programs attached and maps converged", n), func() bool {
		for _, hook := range []string{"egress", "ingress"} {
			if _, err := os.Stat(filepath.Join(pinDir, "links", fmt.Sprintf("%d-%s", eth0.Attrs().Index, hook))); err != nil {
				return false
			}
		}
		out, err := nonmasqmaps.Format(bpf.Pinned{Dir: pinDir})
		if err != nil {
			return false
		}
		// n CIDRs and 169.254.0.0/16 (masqLinkLocal: false).
		return strings.Count(out, "nonmasq_v4 ") == n+1
	})
	return pinDir
}

func waitFor(b *testing.B, what string, cond func() bool) {
	b.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return
		}
	}
	b.Fatalf("timed out waiting for %s", what)
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// datapathCounters reads the agent's datapath counters (non-zero ones).
func datapathCounters(pinDir string) (map[string]uint64, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, bpf.MapCounters), nil)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	vals, err := bpf.ReadCounters(m)
	if err != nil {
		return nil, err
	}
	out := map[string]uint64{}
	for i, v := range vals {
		if v != 0 {
			out[bpf.Counter(i).String()] = v
		}
	}
	return out, nil
}
