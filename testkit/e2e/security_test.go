package e2e

import (
	"bufio"
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
)

const securityConfig = "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\nmasqLinkLocal: false\nmasqLinkLocalIPv6: false\n"

// shellCmd runs "ipmasq-agent shell <line>" against a's shell socket.
func shellCmd(a *agent, line string) (string, error) {
	out, err := exec.Command(agentBin, "shell", "--shell-sock-path="+filepath.Join(a.dir, "shell.sock"), line).CombinedOutput()
	return string(out), err
}

// waitAnswers waits until the agent accepts connections on the unix socket
// at path (the file appears at bind, a moment before the agent listens).
func waitAnswers(a *agent, path string) {
	a.t.Helper()
	a.waitFor(path+" to answer", func() bool {
		c, err := net.Dial("unix", path)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
}

// TestShellReadOnly: the built agent's shell refuses every command that
// executes, touches files or writes tables with one line naming it, and
// answers every inspection command.
func TestShellReadOnly(t *testing.T) {
	topo, a, ext := setup(t, securityConfig, "--egress-route-table=11")
	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 1)
	client := ipamapi.NewClient(filepath.Join(a.dir, "api.sock"))
	ep, err := client.Allocate(context.Background(), ipamapi.AllocationRequest{Owner: "pod-a", Family: "ipv4"})
	if err != nil {
		t.Fatalf("allocate: %v", err)
	}
	written := filepath.Join(a.dir, "written-by-shell")
	waitAnswers(a, filepath.Join(a.dir, "shell.sock"))

	for line, want := range map[string]string{
		"exec id":                                     "exec: not available in the agent's read-only shell; it runs programs as the agent",
		"exec touch " + written:                       "exec: not available in the agent's read-only shell; it runs programs as the agent",
		"cat /etc/hostname":                           "cat: not available in the agent's read-only shell; it reads files as the agent",
		"grep root /etc/passwd":                       "grep: not available in the agent's read-only shell; it reads files as the agent",
		"cp /etc/hostname " + written:                 "cp: not available in the agent's read-only shell; it changes files as the agent",
		"mkdir " + written:                            "mkdir: not available in the agent's read-only shell; it changes files as the agent",
		"rm " + a.config:                              "rm: not available in the agent's read-only shell; it changes files as the agent",
		"db/insert nonmasq-cidrs x.yaml":              "db/insert: not available in the agent's read-only shell; it writes the agent's desired state",
		"db/delete nonmasq-cidrs x.yaml":              "db/delete: not available in the agent's read-only shell; it writes the agent's desired state",
		"db/cmp nonmasq-cidrs /etc/passwd":            "db/cmp: not available in the agent's read-only shell; it reads files as the agent",
		"hive/stop":                                   "hive/stop: not available in the agent's read-only shell; it starts or stops",
		"db/show -o " + written + " endpoints":        "db/show --out: not available in the agent's read-only shell; it writes a file as the agent",
		"db/dump --out=" + written:                    "db/dump --out: not available in the agent's read-only shell; it writes a file as the agent",
		"db/get --delete endpoints " + ep.IP.String(): "db/get --delete: not available in the agent's read-only shell; it deletes rows",
		"db/prefix --delete nonmasq-cidrs 10.0.0.0/8": "db/prefix --delete: not available in the agent's read-only shell; it deletes rows",
		"no/such-command":                             "no/such-command: unknown command; not available in the agent's read-only shell",
	} {
		out, err := shellCmd(a, line)
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 1 {
			t.Errorf("%q: %v, want exit status 1; output %q", line, err, out)
		}
		if strings.Count(out, "\n") != 1 || !strings.HasPrefix(out, "ipmasq-agent: "+want) {
			t.Errorf("%q: output %q, want one line starting %q", line, out, "ipmasq-agent: "+want)
		}
	}
	if _, err := os.Stat(written); !os.IsNotExist(err) {
		t.Errorf("a refused command created %s (stat: %v)", written, err)
	}
	if _, err := os.Stat(a.config); err != nil {
		t.Errorf("the config file is gone after a refused rm: %v", err)
	}

	for line, want := range map[string]string{
		"db":                                     "nonmasq-cidrs",
		"db/show nonmasq-cidrs":                  "10.0.0.0/8",
		"db/show --format=json endpoints":        `"owner": "pod-a"`,
		"db/get endpoints " + ep.IP.String():     "pod-a",
		"db/get nonmasq-cidrs 192.168.0.0/16":    "192.168.0.0/16",
		"db/list -i owner endpoints pod-a":       ep.IP.String(),
		"db/prefix -i owner endpoints pod-":      ep.IP.String(),
		"db/lowerbound nonmasq-cidrs 10.0.0.0/8": "192.168.0.0/16",
		"db/dump":                                `"nonmasq-cidrs"`,
		"db/initialized nonmasq-cidrs":           "",
		"health":                                 ": OK: ",
		"help":                                   "db/show",
		"maps/dump":                              "nonmasq_v4 10.0.0.0/8",
		"maps/stats":                             "nonmasq_v4 entries=",
		"maps/resync":                            "",
		"datapath/counters":                      "",
		"datapath/nat":                           "masquerade ipv4 tcp ",
		"datapath/gc":                            "",
		"rules/dump":                             "111: from " + ep.IP.String() + " to 10.0.0.0/8 lookup 11",
		"rules/stats":                            "rules=",
		"config/status":                          "generation 1",
		"ipmasq/status":                          "Endpoints:  1",
	} {
		out, err := shellCmd(a, line)
		if err != nil || !strings.Contains(out, want) {
			t.Errorf("%q: %v, want output containing %q:\n%s", line, err, want, out)
		}
	}
	// The refused writes changed nothing.
	if out, _ := shellCmd(a, "db/show endpoints"); !strings.Contains(out, "pod-a") {
		t.Errorf("endpoints after refused writes:\n%s", out)
	}
	if out, _ := shellCmd(a, "maps/dump nonmasq_v4"); !strings.Contains(out, "10.0.0.0/8") || !strings.Contains(out, "192.168.0.0/16") {
		t.Errorf("maps after refused writes:\n%s", out)
	}

	// An interactive session (hive's client, commands on stdin) gets the
	// same answers and goes on after a refusal.
	session := exec.Command(agentBin, "shell", "--shell-sock-path="+filepath.Join(a.dir, "shell.sock"))
	// The client reads a terminal: Enter is a carriage return.
	session.Stdin = strings.NewReader("exec id\rdb/show endpoints\rhelp -a datapath/\r")
	out, err := session.CombinedOutput()
	for _, want := range []string{"exec: not available in the agent's read-only shell", "pod-a", "datapath/nat"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("interactive session (%v) lacks %q:\n%s", err, want, out)
		}
	}

	// db/watch streams until the client goes away: an allocation shows up.
	conn, err := net.Dial("unix", filepath.Join(a.dir, "shell.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("db/watch endpoints\n")); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(conn)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	if _, err := client.Allocate(context.Background(), ipamapi.AllocationRequest{Owner: "pod-watched", Family: "ipv4"}); err != nil {
		t.Fatal(err)
	}
	timeout := time.After(10 * time.Second)
	for seen := false; !seen; {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatal("db/watch: connection closed before the new endpoint showed")
			}
			seen = strings.Contains(l, "pod-watched")
		case <-timeout:
			t.Fatal("db/watch did not show the new endpoint within 10s")
		}
	}
}

// TestCreatedPathModes runs the agent with umask 0 in fresh directories,
// exercises what creates files (traffic, allocations, a restart), and checks
// the mode of every path it created: sockets and files 0600, directories
// 0700, so nothing the agent makes is readable by anyone but root.
func TestCreatedPathModes(t *testing.T) {
	// The agent creates this directory for both sockets.
	run := filepath.Join(t.TempDir(), "run")
	// The agent must not rely on the umask for any mode.
	defer syscall.Umask(syscall.Umask(0))
	topo, a, ext := setup(t, securityConfig, "--egress-route-table=11",
		"--api-socket="+filepath.Join(run, "api.sock"),
		"--shell-sock-path="+filepath.Join(run, "shell.sock"))
	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 1)
	client := ipamapi.NewClient(filepath.Join(run, "api.sock"))
	if _, err := client.Allocate(context.Background(), ipamapi.AllocationRequest{Owner: "pod-a", Family: "ipv4"}); err != nil {
		t.Fatalf("allocate: %v", err)
	}
	// A restart snapshots the state and reopens every pin.
	a.stop(syscall.SIGTERM)
	a.start()
	waitAnswers(a, filepath.Join(run, "api.sock"))
	waitAnswers(a, filepath.Join(run, "shell.sock"))
	if _, err := client.Allocate(context.Background(), ipamapi.AllocationRequest{Owner: "pod-b", Family: "ipv6"}); err != nil {
		t.Fatalf("allocate after restart: %v", err)
	}
	if out, err := exec.Command(agentBin, "status", "--shell-sock-path="+filepath.Join(run, "shell.sock")).CombinedOutput(); err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}

	roots := map[string]string{"run": run, "state": filepath.Join(a.dir, "state"), "<bpffs>/ipmasq": filepath.Join(a.bpfRoot, "ipmasq")}
	var created []string
	for label, root := range roots {
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fi, err := os.Lstat(path)
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, path)
			created = append(created, filepath.Join(label, rel)+" "+fi.Mode().String())
			var want fs.FileMode
			switch fi.Mode().Type() {
			case fs.ModeDir:
				want = fs.ModeDir | 0o700
			case fs.ModeSocket:
				want = fs.ModeSocket | 0o600
			case 0:
				want = 0o600
			default:
				t.Errorf("%s: unexpected file type %s", path, fi.Mode())
				return nil
			}
			if fi.Mode() != want {
				t.Errorf("%s: mode %s, want %s", path, fi.Mode(), want)
			}
			if st, ok := fi.Sys().(*syscall.Stat_t); ok && (st.Uid != 0 || st.Gid != 0) {
				t.Errorf("%s: owner %d:%d, want root", path, st.Uid, st.Gid)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("walk %s: %v", root, err)
		}
	}
	slices.Sort(created)
	t.Logf("paths the agent created:\n%s", strings.Join(created, "\n"))
	// The walk saw what it had to: the check above cannot pass on an empty tree.
	for _, want := range []string{"run/api.sock", "run/shell.sock", "state/endpoints.journal",
		"<bpffs>/ipmasq/nonmasq_v4", "<bpffs>/ipmasq/links", "<bpffs>/ipmasq/" + bpf.MapNATV4} {
		if !slices.ContainsFunc(created, func(c string) bool { return strings.HasPrefix(c, want+" ") }) {
			t.Errorf("the agent did not create %s", want)
		}
	}
}
