package e2e

import (
	"context"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// The agent writes no sysctl: masqueraded flows stay clear of
// the node's own sockets because the datapath asks the node's socket table
// for every port it gives, as conntrack's nf_nat_used_tuple asks conntrack,
// and a node flow that clashes with a pair gets another port, as
// conntrack's null binding remaps it. Each scenario runs under Linux
// MASQUERADE first (iptables-nft in the node, the rules upstream's agent
// writes for the same flags), then under ipmasq, on fresh topologies.

// netSysctls reads every readable sysctl of n's network namespace
// (/proc/sys/net), but the counters that move with traffic.
func netSysctls(t *testing.T, n *topology.Netns) map[string]string {
	t.Helper()
	out := map[string]string{}
	if err := n.Do(func() error {
		return filepath.WalkDir("/proc/sys/net", func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return nil
			}
			if strings.HasSuffix(path, "nf_conntrack_count") {
				return nil
			}
			data, err := os.ReadFile(path)
			if err != nil {
				return nil // write-only (route/flush) or refused
			}
			out[path] = string(data)
			return nil
		})
	}); err != nil {
		t.Fatal(err)
	}
	if len(out) < 100 {
		t.Fatalf("read %d sysctls of %s: too few", len(out), n.Name)
	}
	return out
}

// sameSysctls fails the test for every sysctl of before that n no longer
// has with the same value.
func sameSysctls(t *testing.T, n *topology.Netns, before map[string]string) {
	t.Helper()
	after := netSysctls(t, n)
	changed := 0
	for k, v := range before {
		if a, ok := after[k]; !ok || a != v {
			t.Errorf("%s in %s: %q, was %q", k, n.Name, a, v)
			changed++
		}
	}
	if changed == 0 {
		t.Logf("%d sysctls of %s as they were", len(before), n.Name)
	}
}

// readSysctl reads one sysctl of n.
func readSysctl(t *testing.T, n *topology.Netns, name string) string {
	t.Helper()
	var data []byte
	if err := n.Do(func() (err error) { data, err = os.ReadFile("/proc/sys/" + name); return err }); err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(data))
}

// nodeConnects opens count TCP connections from n's own stack to dst, the
// kernel choosing each source port, and returns how many connected and
// the ports the server saw (serveWhoAmI). The connections stay open until
// the test ends, so each holds its port.
func nodeConnects(t *testing.T, n *topology.Netns, dst netip.AddrPort, count int) (ok int, seen []netip.AddrPort, errs []error) {
	t.Helper()
	for range count {
		var c net.Conn
		err := n.Do(func() (err error) {
			d := net.Dialer{Timeout: 3 * time.Second}
			c, err = d.DialContext(context.Background(), "tcp", dst.String())
			return err
		})
		if err != nil {
			errs = append(errs, err)
			continue
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 64)
		m, err := c.Read(buf)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		ap, err := netip.ParseAddrPort(strings.TrimSpace(string(buf[:m])))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		ok++
		seen = append(seen, ap)
	}
	return ok, seen, errs
}

// sysctlCase is a node whose sysctls the agent must leave alone.
type sysctlCase struct {
	// localRange is the node's ip_local_port_range ("" for the default).
	localRange string
	// reference are the MASQUERADE rules' extra arguments (--to-ports
	// per range and protocol), as upstream's agent writes them for args.
	args []string
	// readOnly runs the agent with /proc/sys read-only.
	readOnly bool
	// inRange says whether a masqueraded port is one the flags allow.
	inRange func(port uint16) bool
}

// runSysctlCase runs the scenario of c under MASQUERADE and ipmasq: the
// masquerader starts (ipmasq's agent with /proc/sys read-only where asked),
// 20 pod connections are masqueraded to ports c allows, and 20 of 20 of
// the node's own connections to the same server connect, their ports
// chosen by the node's kernel; ip_local_reserved_ports is as it was; under
// ipmasq, after a stop and `ipmasq-agent uninstall`, every sysctl of the
// node's namespace is as before the agent started.
func runSysctlCase(t *testing.T, c sysctlCase) {
	var (
		a               *agent
		before          map[string]string
		referenceFailed bool
	)
	prepare := func(t *testing.T, topo *topology.Masquerade) {
		if c.localRange != "" {
			if err := topo.Node.Sysctl("net/ipv4/ip_local_port_range", c.localRange); err != nil {
				t.Fatal(err)
			}
		}
		before = netSysctls(t, topo.Node)
	}
	reference := masquerader{name: "MASQUERADE", start: func(t *testing.T, topo *topology.Masquerade) {
		prepare(t, topo)
		uc := upstreamCase{name: "reference", file: file(masqueradeAll), args: c.args}
		rules := upstreamRules(uc, false)
		if rules == nil {
			t.Fatalf("no upstream rules for %q", c.args)
		}
		for _, r := range rules {
			if err := topo.Node.Iptables(false, r...); err != nil {
				t.Fatalf("iptables %q: %v", r, err)
			}
		}
		a = nil
	}}
	ipmasq := masquerader{name: "ipmasq", start: func(t *testing.T, topo *topology.Masquerade) {
		if referenceFailed {
			t.Fatal("the reference (Linux MASQUERADE) failed on this topology: the scenario proves nothing")
		}
		prepare(t, topo)
		a = newAgent(t, topo.Node, masqueradeAll)
		a.args = c.args
		a.readOnlyProcSys = c.readOnly
		a.start()
	}}
	runEach(t, []masquerader{reference, ipmasq}, func(t *testing.T, topo *topology.Masquerade) {
		if a == nil {
			t.Cleanup(func() { referenceFailed = t.Failed() })
		}
		reserved := readSysctl(t, topo.Node, "net/ipv4/ip_local_reserved_ports")
		serveWhoAmI(t, topo.Ext)
		dst := netip.AddrPortFrom(topology.RemoteIP4, whoAmIPort)
		leaks := watchLeaks(t, topo.Ext, "eth0", topology.PodCIDR4, topology.PodCIDR6)

		for i := range 20 {
			_, _, seen := tcpFrom(t, topo.Pod, netip.AddrPortFrom(topology.PodIP4, 0), dst)
			if seen.Addr() != topology.NodeIP4 || !c.inRange(seen.Port()) {
				t.Fatalf("pod connection %d: server saw %s, want %s and a port the flags allow", i, seen, topology.NodeIP4)
			}
		}
		ok, seen, errs := nodeConnects(t, topo.Node, dst, 20)
		if ok != 20 {
			t.Fatalf("%d of 20 of the node's own connections connected: %v", ok, errs)
		}
		for _, s := range seen {
			if s.Addr() != topology.NodeIP4 {
				t.Fatalf("node connection seen from %s", s)
			}
		}
		if got := readSysctl(t, topo.Node, "net/ipv4/ip_local_reserved_ports"); got != reserved {
			t.Fatalf("ip_local_reserved_ports = %q while masquerading, was %q", got, reserved)
		}
		leaks.check(t)
		if a == nil {
			sameSysctls(t, topo.Node, before)
			return
		}
		a.stop(syscall.SIGTERM)
		out, errOut, err := runUninstall(topo.Node, []string{
			"--bpf-root=" + a.bpfRoot,
			"--state-dir=" + filepath.Join(a.dir, "state"),
			"--api-socket=" + filepath.Join(a.dir, "api.sock"),
			"--shell-sock-path=" + filepath.Join(a.dir, "shell.sock"),
		})
		if err != nil {
			t.Fatalf("uninstall: %v\n%s%s", err, out, errOut)
		}
		if strings.Contains(out, "ip_local_reserved_ports") {
			t.Fatalf("uninstall touched ip_local_reserved_ports, which this agent never wrote:\n%s", out)
		}
		sameSysctls(t, topo.Node, before)
	})
}

// TestWideLocalRangeReadOnlyProcSys: a node with a widened local range. The node's
// ip_local_port_range is 1024-65535 (a common tuning), which covers the
// default --nat-port-range 61000-65535, and /proc/sys is read-only as the
// DaemonSet's container has it: the agent starts (it used to exit, failing
// to reserve the range), masquerades, the node's own connections work, and
// nothing was written.
func TestWideLocalRangeReadOnlyProcSys(t *testing.T) {
	runSysctlCase(t, sysctlCase{
		localRange: "1024 65535",
		readOnly:   true,
		// Upstream's default --random-fully, which ipmasq gives with
		// its own flag's default (ports kept when free) only when asked:
		// both give a port of 1024-65535 here.
		args:    nil,
		inRange: func(p uint16) bool { return p >= 1024 },
	})
}

// TestToPortsExampleKeepsNodeConnections: upstream's own --to-ports example.
// Upstream's own example, --to-ports=1024-29999,32768-65535, covers the
// node's whole default ip_local_port_range (32768-60999): the agent used to
// reserve 32768-65535 in ip_local_reserved_ports, and 0 of 20 of the node's
// own connections connected (EADDRNOTAVAIL), also after it stopped and
// after the uninstall. Now 20 of 20 connect, the masqueraded ports are of
// the ranges, and no sysctl changes.
func TestToPortsExampleKeepsNodeConnections(t *testing.T) {
	runSysctlCase(t, sysctlCase{
		args: []string{"--to-ports=1024-29999,32768-65535"},
		inRange: func(p uint16) bool {
			return p >= 1024 && p <= 29999 || p >= 32768
		},
	})
}

// TestNodePortsInNATRange: the node's kernel and the NAT share one small
// range (ip_local_port_range 40000-40039, --to-ports=40000-40039), which
// nothing reserves: ten pod connections hold ports of it toward a server,
// then ten of the node's own connections to the same server get ports of
// it from their kernel, some of them ports a pod's pair holds. Every
// connection carries data both ways: the pods' pairs skip the node's
// sockets, and a node connection that clashes with a pair is given another
// port (under MASQUERADE, by conntrack's null binding).
func TestNodePortsInNATRange(t *testing.T) {
	var (
		a               *agent
		referenceFailed bool
	)
	args := []string{"--to-ports=40000-40039", "--random-fully=false"}
	prepare := func(t *testing.T, topo *topology.Masquerade) {
		if err := topo.Node.Sysctl("net/ipv4/ip_local_port_range", "40000 40039"); err != nil {
			t.Fatal(err)
		}
	}
	reference := masquerader{name: "MASQUERADE", start: func(t *testing.T, topo *topology.Masquerade) {
		prepare(t, topo)
		for _, r := range upstreamRules(upstreamCase{name: "reference", file: file(masqueradeAll), args: args}, false) {
			if err := topo.Node.Iptables(false, r...); err != nil {
				t.Fatalf("iptables %q: %v", r, err)
			}
		}
		a = nil
	}}
	ipmasq := masquerader{name: "ipmasq", start: func(t *testing.T, topo *topology.Masquerade) {
		if referenceFailed {
			t.Fatal("the reference (Linux MASQUERADE) failed on this topology: the scenario proves nothing")
		}
		prepare(t, topo)
		a = newAgent(t, topo.Node, masqueradeAll)
		a.args = args
		a.start()
	}}
	runEach(t, []masquerader{reference, ipmasq}, func(t *testing.T, topo *topology.Masquerade) {
		if a == nil {
			t.Cleanup(func() { referenceFailed = t.Failed() })
		}
		serveWhoAmI(t, topo.Ext)
		dst := netip.AddrPortFrom(topology.RemoteIP4, whoAmIPort)
		type conn struct {
			what string
			c    net.Conn
		}
		var conns []conn
		ports := map[uint16]string{}
		for i := range 10 {
			c, _, seen := tcpFrom(t, topo.Pod, netip.AddrPortFrom(topology.PodIP4, uint16(40000+i)), dst)
			if seen.Addr() != topology.NodeIP4 || seen.Port() < 40000 || seen.Port() > 40039 {
				t.Fatalf("pod connection %d: server saw %s, want %s:40000-40039", i, seen, topology.NodeIP4)
			}
			ports[seen.Port()] = "pod " + strconv.Itoa(i)
			conns = append(conns, conn{"pod " + strconv.Itoa(i), c})
		}
		for i := range 10 {
			var c net.Conn
			if err := topo.Node.Do(func() (err error) {
				c, err = (&net.Dialer{Timeout: 3 * time.Second}).Dial("tcp", dst.String())
				return err
			}); err != nil {
				t.Fatalf("node connection %d: %v", i, err)
			}
			t.Cleanup(func() { c.Close() })
			c.SetDeadline(time.Now().Add(5 * time.Second))
			buf := make([]byte, 64)
			m, err := c.Read(buf)
			if err != nil {
				t.Fatalf("node connection %d from port %s: no answer: %v", i, c.LocalAddr(), err)
			}
			seen := netip.MustParseAddrPort(strings.TrimSpace(string(buf[:m])))
			if who, dup := ports[seen.Port()]; dup {
				t.Fatalf("node connection %d seen from port %d, which %s has", i, seen.Port(), who)
			}
			ports[seen.Port()] = "node " + strconv.Itoa(i)
			conns = append(conns, conn{"node " + strconv.Itoa(i), c})
		}
		for _, c := range conns {
			c.c.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.c.Write([]byte("ping\n")); err != nil {
				t.Fatalf("%s: write: %v", c.what, err)
			}
			buf := make([]byte, 5)
			if _, err := io.ReadFull(c.c, buf); err != nil || string(buf) != "ping\n" {
				t.Fatalf("%s: echo %q, %v", c.what, buf, err)
			}
		}
		if a != nil {
			t.Logf("counters:\n%s", a.counters())
		}
	})
}

// TestUninstallTakesBackOldReservation: versions before this one appended
// --nat-port-range to ip_local_reserved_ports when it overlapped the local
// range. In a node namespace holding such a reservation beside the
// operator's own (8080,61000-65535), the agent leaves the list alone while
// it runs; an uninstall with /proc/sys read-only (the Job's container) says
// what to run on the node and changes nothing; an uninstall that can write
// takes 61000-65535 back and keeps 8080; every other sysctl is as before.
func TestUninstallTakesBackOldReservation(t *testing.T) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	if err := topo.Node.Sysctl("net/ipv4/ip_local_port_range", "1024 65535"); err != nil {
		t.Fatal(err)
	}
	if err := topo.Node.Sysctl("net/ipv4/ip_local_reserved_ports", "8080,61000-65535"); err != nil {
		t.Fatal(err)
	}
	before := netSysctls(t, topo.Node)
	startServers(t, topo.Ext, topology.RemoteIP4)
	a := newAgent(t, topo.Node, masqueradeAll)
	flags := []string{
		"--bpf-root=" + a.bpfRoot,
		"--state-dir=" + filepath.Join(a.dir, "state"),
		"--api-socket=" + filepath.Join(a.dir, "api.sock"),
		"--shell-sock-path=" + filepath.Join(a.dir, "shell.sock"),
	}
	reserved := func() string { return readSysctl(t, topo.Node, "net/ipv4/ip_local_reserved_ports") }

	// 1. The agent leaves the list as it is, and masquerades.
	a.start()
	if src, err := tcpSource(topo.Pod, topology.RemoteIP4); err != nil || src != topology.NodeIP4.String() {
		t.Fatalf("pod -> remote: seen from %q (%v)", src, err)
	}
	if got := reserved(); got != "8080,61000-65535" {
		t.Fatalf("ip_local_reserved_ports = %q while the agent runs, want it as it was", got)
	}
	a.stop(syscall.SIGTERM)

	// 2. Uninstall with /proc/sys read-only: a line saying what to run,
	// exit 0, the list unchanged.
	args := append([]string{"--mount", "--propagation", "private", "/bin/sh", "-c",
		`mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec "$@"`, "sh",
		"setpriv", "--bounding-set=-all,+net_admin,+bpf", "--inh-caps=-all", agentBin, "uninstall"}, flags...)
	var out []byte
	err = topo.Node.Do(func() (err error) { out, err = exec.Command("unshare", args...).CombinedOutput(); return err })
	if err != nil || !strings.Contains(string(out), `sysctl -w net.ipv4.ip_local_reserved_ports="8080"`) {
		t.Fatalf("uninstall with /proc/sys read-only: %v\n%s\nwant exit 0 and the sysctl to run on the node", err, out)
	}
	if got := reserved(); got != "8080,61000-65535" {
		t.Fatalf("ip_local_reserved_ports = %q after a read-only uninstall", got)
	}

	// 3. Installed again, stopped, uninstalled where it can write: the
	// older version's range goes, the operator's 8080 stays.
	a.start()
	a.stop(syscall.SIGTERM)
	stdout, errOut, err := runUninstall(topo.Node, flags)
	if err != nil || !strings.Contains(stdout, "removed 61000-65535 from /proc/sys/net/ipv4/ip_local_reserved_ports (reserved by an older ipmasq)") {
		t.Fatalf("uninstall: %v\n%s%s", err, stdout, errOut)
	}
	if got := reserved(); got != "8080" {
		t.Fatalf("ip_local_reserved_ports = %q after the uninstall, want 8080", got)
	}
	before["/proc/sys/net/ipv4/ip_local_reserved_ports"] = "8080\n"
	sameSysctls(t, topo.Node, before)

	// 4. A second uninstall finds nothing of ipmasq and leaves 8080.
	if stdout, _, err := runUninstall(topo.Node, flags); err != nil || !strings.Contains(stdout, "nothing of ipmasq found") {
		t.Fatalf("second uninstall: %v\n%s", err, stdout)
	}
	if got := reserved(); got != "8080" {
		t.Fatalf("ip_local_reserved_ports = %q after a second uninstall", got)
	}
}
