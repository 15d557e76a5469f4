package shell_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	hiveshell "github.com/cilium/hive/shell"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/readers/shell"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/iprulestest"
)

// TestEveryCommandDecided fails when the agent registers a command (or the
// script engine has a general command) that the shell neither allows nor
// explicitly refuses: adding one means deciding whether it is safe on a live
// agent. It also fails on an allow-list entry that names no command.
func TestEveryCommandDecided(t *testing.T) {
	dir := t.TempDir()
	h := agent.New(cell.Provide(func() iprules.Target { return iprulestest.NewMemoryTarget() }))
	flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse([]string{
		"--bpf-root=" + filepath.Join(dir, "bpf"),
		"--ip-masq-agent-config-path=" + filepath.Join(dir, "none"),
		"--state-dir=" + filepath.Join(dir, "state"),
		"--api-socket=" + filepath.Join(dir, "api.sock"),
		"--shell-sock-path=",
	}); err != nil {
		t.Fatal(err)
	}
	registered, err := h.ScriptCommands(hivetest.Logger(t, hivetest.LogLevel(slog.LevelError)))
	if err != nil {
		t.Fatalf("agent hive: %v", err)
	}
	for name, cmd := range script.DefaultCmds() {
		registered[name] = cmd
	}
	for name := range registered {
		if name == "help" {
			continue // the shell has its own
		}
		switch {
		case shell.Allowed(name) && shell.Refused(name):
			t.Errorf("%s is both allowed and refused", name)
		case !shell.Allowed(name) && !shell.Refused(name):
			t.Errorf("%s is registered but neither allowed nor refused: decide whether it is safe on a live agent (readers/shell/policy.go)", name)
		}
	}
	for _, name := range shell.AllowList() {
		if _, ok := registered[name]; !ok {
			t.Errorf("allow-list names %s, which the agent does not register", name)
		}
	}
	// The commands the issue names stay available.
	for _, name := range []string{"db/show", "db/get", "db/list", "db/prefix", "db/lowerbound", "db/dump", "db/watch",
		"health", "maps/dump", "datapath/nat", "datapath/counters", "ipmasq/status", "config/status", "rules/dump", "datapath/gc"} {
		if !shell.Allowed(name) {
			t.Errorf("%s is not allowed", name)
		}
	}
}

// testShell serves the read-only shell of a small hive (StateDB with the
// endpoints table holding one row, health) on a socket in a directory the
// shell creates.
func testShell(t *testing.T) (sock string, db *statedb.DB, eps statedb.RWTable[*tables.Endpoint]) {
	sock = filepath.Join(t.TempDir(), "run", "shell.sock")
	h := hive.New(
		agent.Infrastructure,
		cell.Provide(
			tables.NewEndpointTable,
			statedb.RWTable[*tables.Endpoint].ToTable,
		),
		cell.Invoke(func(d *statedb.DB, tbl statedb.RWTable[*tables.Endpoint]) {
			wtxn := d.WriteTxn(tbl)
			tbl.Insert(wtxn, &tables.Endpoint{IP: netip.MustParseAddr("10.244.1.2"), Owner: "pod-a"})
			wtxn.Commit()
			db, eps = d, tbl
		}),
		shell.Cell,
	)
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse([]string{"--shell-sock-path=" + sock}); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelError))
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return sock, db, eps
}

// run sends one command the way "ipmasq-agent shell <cmd>" does.
func run(sock, cmd string) (string, error) {
	var out bytes.Buffer
	err := hiveshell.ShellExchange(hiveshell.Config{ShellSockPath: sock}, &out, "%s", cmd)
	return out.String(), err
}

// TestRefusals: executing, file-touching and table-writing commands and
// flags are refused with one line naming them and why; nothing happens.
func TestRefusals(t *testing.T) {
	sock, db, eps := testShell(t)
	target := filepath.Join(t.TempDir(), "written")
	for cmd, want := range map[string]string{
		"exec id":                                   "exec: not available in the agent's read-only shell; it runs programs as the agent",
		"exec touch " + target:                      "exec: not available in the agent's read-only shell; it runs programs as the agent",
		"cat /etc/hostname":                         "cat: not available in the agent's read-only shell; it reads files as the agent",
		"cp /etc/hostname " + target:                "cp: not available in the agent's read-only shell; it changes files as the agent",
		"mkdir " + target:                           "mkdir: not available in the agent's read-only shell; it changes files as the agent",
		"db/insert endpoints x.yaml":                "db/insert: not available in the agent's read-only shell; it writes the agent's desired state",
		"db/delete endpoints x.yaml":                "db/delete: not available in the agent's read-only shell; it writes the agent's desired state",
		"db/cmp endpoints /etc/shadow":              "db/cmp: not available in the agent's read-only shell; it reads files as the agent",
		"hive/stop":                                 "hive/stop: not available in the agent's read-only shell; it starts or stops",
		"db/show -o " + target + " endpoints":       "db/show --out: not available in the agent's read-only shell; it writes a file as the agent",
		"db/dump --out=" + target:                   "db/dump --out: not available in the agent's read-only shell; it writes a file",
		"db/get --delete endpoints 10.244.1.2":      "db/get --delete: not available in the agent's read-only shell; it deletes rows",
		"db/prefix --delete endpoints 10.":          "db/prefix --delete: not available in the agent's read-only shell; it deletes rows",
		"db/list -i owner --delete endpoints pod-a": "db/list --delete: not available in the agent's read-only shell; it deletes rows",
		"nosuch/command":                            "nosuch/command: unknown command; not available in the agent's read-only shell",
	} {
		out, err := run(sock, cmd)
		if err == nil {
			t.Errorf("%q: no error; output %q", cmd, out)
			continue
		}
		if !strings.HasPrefix(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%q: error %q, want one line starting %q", cmd, err, want)
		}
		if !strings.HasSuffix(err.Error(), "(help lists what the shell offers)") {
			t.Errorf("%q: error %q does not point at help", cmd, err)
		}
	}
	if _, err := os.Stat(target); !os.IsNotExist(err) {
		t.Errorf("a refused command created %s (stat: %v)", target, err)
	}
	if n := eps.NumObjects(db.ReadTxn()); n != 1 {
		t.Errorf("endpoints holds %d rows after refused writes, want 1", n)
	}
}

// TestInspection: the inspection commands answer, help lists only what the
// shell offers, a panicking command does not end the session, and the
// socket and the directory the shell created are root-only.
func TestInspection(t *testing.T) {
	sock, _, _ := testShell(t)
	for cmd, want := range map[string]string{
		"db":                                "endpoints",
		"db/show endpoints":                 "10.244.1.2",
		"db/show --format=json endpoints":   `"owner": "pod-a"`,
		"db/get endpoints 10.244.1.2":       "pod-a",
		"db/list -i owner endpoints pod-a":  "10.244.1.2",
		"db/prefix -i owner endpoints pod-": "10.244.1.2",
		"db/lowerbound endpoints 10.0.0.0":  "pod-a",
		"db/dump":                           `"endpoints"`,
		"db/initialized endpoints":          "",
		"health":                            "",
		"help":                              "db/show",
		"help -a db/":                       "db/lowerbound",
		"help -v db/show":                   "--columns",
	} {
		out, err := run(sock, cmd)
		if err != nil {
			t.Errorf("%q: %v", cmd, err)
			continue
		}
		if !strings.Contains(out, want) {
			t.Errorf("%q: output lacks %q:\n%s", cmd, want, out)
		}
	}
	// help names only allowed commands, and hides the refused flags.
	help, err := run(sock, "help")
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, line := range strings.Split(help, "\n") {
		if line != "" && line[0] != '\t' && line[0] != ' ' {
			listed = append(listed, strings.Fields(line)[0])
		}
	}
	for _, name := range listed {
		if name != "help" && !shell.Allowed(name) {
			t.Errorf("help lists %s, which the shell does not offer", name)
		}
	}
	if !slices.Contains(listed, "db/show") || !slices.Contains(listed, "health") {
		t.Errorf("help lists %v, want db/show and health among them", listed)
	}
	verbose, err := run(sock, "help -v")
	if err != nil {
		t.Fatal(err)
	}
	for _, hidden := range []string{"--out", "--delete"} {
		if strings.Contains(verbose, hidden) {
			t.Errorf("help -v shows %q:\n%s", hidden, verbose)
		}
	}
	// A command that panics (health with a bad regexp) is an error of that
	// command; the same session goes on.
	var out bytes.Buffer
	err = hiveshell.ShellExchange(hiveshell.Config{ShellSockPath: sock}, &out, "health '('")
	if err == nil || !strings.Contains(err.Error(), "internal error") {
		t.Errorf("health '(': %v, want an internal error", err)
	}
	if out, err := run(sock, "db/show endpoints"); err != nil || !strings.Contains(out, "pod-a") {
		t.Errorf("shell after a panic: %v %q", err, out)
	}
	for path, want := range map[string]os.FileMode{sock: os.ModeSocket | 0o600, filepath.Dir(sock): os.ModeDir | 0o700} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode() != want {
			t.Errorf("%s: mode %s, want %s", path, fi.Mode(), want)
		}
	}
}

// TestWatch: db/watch streams changes until the client goes away.
func TestWatch(t *testing.T) {
	sock, db, eps := testShell(t)
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintln(conn, "db/watch endpoints")
	deadline := time.Now().Add(10 * time.Second)
	var got []byte
	buf := make([]byte, 4096)
	for time.Now().Before(deadline) && !bytes.Contains(got, []byte("pod-b")) {
		wtxn := db.WriteTxn(eps)
		eps.Insert(wtxn, &tables.Endpoint{IP: netip.MustParseAddr("10.244.1.3"), Owner: "pod-b"})
		wtxn.Commit()
		conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		n, _ := conn.Read(buf)
		got = append(got, buf[:n]...)
	}
	if !slices.Contains(strings.Fields(string(got)), "pod-b") {
		t.Fatalf("db/watch did not stream the inserted row:\n%s", got)
	}
}
