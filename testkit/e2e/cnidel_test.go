package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/ipamapi"
)

// cniPlugin runs the ipmasq-cni binary as a runtime does: CNI_* in the
// environment, the network config on stdin.
type cniPlugin struct {
	t   *testing.T
	bin string
}

func (p cniPlugin) run(command, containerID string, netconf []byte) (stdout, stderr string, err error) {
	cmd := exec.Command(p.bin)
	cmd.Env = append(os.Environ(),
		"CNI_COMMAND="+command, "CNI_CONTAINERID="+containerID, "CNI_IFNAME=eth0",
		"CNI_NETNS=/var/run/netns/"+containerID, "CNI_PATH="+filepath.Dir(p.bin))
	cmd.Stdin = bytes.NewReader(netconf)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.String(), e.String(), err
}

// add runs ADD and returns the IPv4 address of the result.
func (p cniPlugin) add(containerID string, netconf []byte) netip.Addr {
	p.t.Helper()
	out, errOut, err := p.run("ADD", containerID, netconf)
	if err != nil {
		p.t.Fatalf("ADD %s: %v\nstdout %s\nstderr %s", containerID, err, out, errOut)
	}
	var res struct {
		IPs []struct {
			Address string `json:"address"`
		} `json:"ips"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil || len(res.IPs) == 0 {
		p.t.Fatalf("ADD %s: result %q: %v", containerID, out, err)
	}
	pfx, err := netip.ParsePrefix(res.IPs[0].Address)
	if err != nil {
		p.t.Fatal(err)
	}
	return pfx.Addr()
}

// del runs DEL, which must succeed (exit 0, nothing on stdout).
func (p cniPlugin) del(containerID string, netconf []byte) string {
	p.t.Helper()
	out, errOut, err := p.run("DEL", containerID, netconf)
	if err != nil || out != "" {
		p.t.Fatalf("DEL %s: %v\nstdout %q\nstderr %s\nwant exit 0 and no output", containerID, err, out, errOut)
	}
	return errOut
}

func buildCNIPlugin(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "ipmasq-cni")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/ipmasq/ipmasq/cmd/ipmasq-cni").CombinedOutput(); err != nil {
		t.Fatalf("build ipmasq-cni: %v\n%s", err, out)
	}
	return bin
}

// TestCNIDelWithoutAgent: the real plugin binary and the real agent
// process. A DEL while the agent is down exits 0 (the pod leaves
// Terminating) and records the release in the agent's state directory;
// the address stays allocated while the release is pending (not handed
// out), is released when the agent is back (at start, before it serves;
// while it runs, within its check interval), and is handed out once
// after: every address of the pool goes to one owner, and a late record
// frees nothing of another owner. After an uninstall a DEL exits 0 and
// writes nothing. Before, the DEL failed ("try again later") for as long
// as the agent was away, and forever after an uninstall.
func TestCNIDelWithoutAgent(t *testing.T) {
	node, _ := cniTopology(t)
	a := newAgent(t, node, "nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	plugin := cniPlugin{t: t, bin: buildCNIPlugin(t)}
	state := filepath.Join(a.dir, "state")
	sock := filepath.Join(a.dir, "api.sock")
	netconf := func(socket string) []byte {
		return fmt.Appendf(nil, `{"cniVersion":"1.1.0","name":"pods","type":"ptp","ipam":{"type":"ipmasq-cni","socketPath":%q,"stateDir":%q}}`, socket, state)
	}
	client := ipamapi.NewClient(sock)
	owners := func() map[string]netip.Addr {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		list, err := client.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]netip.Addr{}
		for _, e := range list {
			if e.IP.Is4() {
				out[e.Owner] = e.IP
			}
		}
		return out
	}
	startAgent := func() {
		t.Helper()
		a.startProcess()
		a.waitFor("the API answering", func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_, err := client.List(ctx)
			return err == nil
		})
	}
	pending := func() []string {
		t.Helper()
		recs, err := ipamapi.PendingReleases(state)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, r := range recs {
			out = append(out, r.Owner)
		}
		return out
	}

	startAgent()
	ip1 := plugin.add("c1", netconf(sock))
	ip2 := plugin.add("c2", netconf(sock))

	// 1. The agent stops (an upgrade): DEL exits 0, twice (the runtime
	// retries), and the release is recorded once.
	a.stop(syscall.SIGTERM)
	note := plugin.del("c1", netconf(sock))
	if !strings.Contains(note, "unreachable") || !strings.Contains(note, "recorded in "+ipamapi.PendingReleaseDir(state)) {
		t.Errorf("DEL with the agent down says %q; want it to name the unreachable agent and the record", note)
	}
	plugin.del("c1", netconf(sock))
	if got := pending(); !slices.Equal(got, []string{"c1/eth0"}) {
		t.Fatalf("pending releases %v, want [c1/eth0]", got)
	}

	// 2. The agent is back: the release is done before it serves, the
	// record is gone, c2 keeps its address.
	startAgent()
	if got := owners(); got["c1/eth0"].IsValid() || got["c2/eth0"] != ip2 {
		t.Fatalf("after the restart: %v; want c1 released and c2 on %s", got, ip2)
	}
	if got := pending(); len(got) != 0 {
		t.Fatalf("records left after the restart: %v", got)
	}

	// 3. Never twice: the whole pool, to new owners: c1's old address goes
	// to exactly one, c2's to none.
	exhaust := func(prefix string) []netip.Addr {
		t.Helper()
		var got []netip.Addr
		for n := 0; ; n++ {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			r, err := client.Allocate(ctx, ipamapi.AllocationRequest{Owner: fmt.Sprintf("%s%d", prefix, n), Family: "ipv4"})
			cancel()
			var e *ipamapi.Error
			if errors.As(err, &e) {
				return got
			}
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, r.IP)
		}
	}
	got := exhaust("fill/")
	if n := len(got); n == 0 {
		t.Fatal("no address left in the pool")
	}
	if slices.Contains(got, ip2) || !slices.Contains(got, ip1) {
		t.Fatalf("allocated %v: want %s (released) among them and %s (held by c2) not", got, ip1, ip2)
	}
	seen := map[netip.Addr]bool{ip2: true}
	for _, ip := range got {
		if seen[ip] {
			t.Fatalf("%s handed out twice", ip)
		}
		seen[ip] = true
	}

	// 4. A release recorded while the agent runs (its socket unreachable to
	// the plugin, here by another path): c2 keeps its address while the
	// record is pending, so the full pool has nothing for anyone else;
	// the running agent does the release within its check interval.
	plugin.del("c2", netconf(filepath.Join(a.dir, "elsewhere.sock")))
	if got := owners(); got["c2/eth0"] != ip2 {
		t.Fatalf("c2 while its release is pending: %v", got)
	}
	if more := exhaust("more/"); len(more) != 0 {
		t.Fatalf("allocated %v while the pool is full and c2's release pending", more)
	}
	a.waitFor("the running agent doing the recorded release", func() bool {
		_, held := owners()["c2/eth0"]
		return !held && len(pending()) == 0
	})
	// A late copy of the record frees nothing of the address's next owner.
	next := exhaust("next/")
	if !slices.Equal(next, []netip.Addr{ip2}) {
		t.Fatalf("after c2's release: allocated %v, want [%s]", next, ip2)
	}
	plugin.del("c2", netconf(filepath.Join(a.dir, "elsewhere.sock")))
	a.stop(syscall.SIGTERM)
	startAgent()
	if got := owners(); got["next/0"] != ip2 {
		t.Fatalf("a late record of c2 released the address's next owner: %v", got)
	}

	// 5. Uninstalled: DEL exits 0 and writes nothing.
	a.stop(syscall.SIGTERM)
	if out, errOut, err := runUninstall(node, []string{"--bpf-root=" + a.bpfRoot, "--state-dir=" + state,
		"--api-socket=" + sock, "--shell-sock-path=" + filepath.Join(a.dir, "shell.sock")}); err != nil {
		t.Fatalf("uninstall: %v\n%s\n%s", err, out, errOut)
	}
	plugin.del("c3", netconf(sock))
	if _, err := os.Lstat(ipamapi.PendingReleaseDir(state)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("DEL after the uninstall left %s: %v", ipamapi.PendingReleaseDir(state), err)
	}
}
