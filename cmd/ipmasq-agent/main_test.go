package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/internal/buildinfo"
)

// run executes the command line and returns the one line an operator would
// see on failure.
// Every path the agent writes is moved into a temporary directory: a
// command line that passes every check starts the agent's cells, and a
// test must not touch the host's /var/lib/ipmasq or /run/ipmasq.
func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	private := t.TempDir()
	t.Setenv("IPMASQ_STATE_DIR", filepath.Join(private, "state"))
	t.Setenv("IPMASQ_API_SOCKET", filepath.Join(private, "run", "api.sock"))
	t.Setenv("IPMASQ_SHELL_SOCK_PATH", filepath.Join(private, "run", "shell.sock"))
	t.Setenv("IPMASQ_IP_MASQ_AGENT_CONFIG_PATH", filepath.Join(private, "config", "ip-masq-agent"))
	cmd := newRootCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.Execute()
	if err != nil {
		return oneLine(err), err
	}
	return out.String(), nil
}

func TestStartErrorsAreOneClearLine(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--bogus"}, "unknown flag: --bogus"},
		{[]string{"--enable-ipv4=maybe"}, `invalid argument "maybe" for "--enable-ipv4"`},
		{[]string{"--enable-ipv4=false", "--enable-ipv6=false"}, "at least one address family must be enabled"},
		{[]string{"--bpf-root=" + dir}, "--bpf-root " + dir + " is not a BPF filesystem"},
		{[]string{"--bpf-root=" + dir + "/missing"}, "is unusable"},
		{[]string{"--log-level=loud"}, `--log-level="loud"`},
		{[]string{"--log-format=xml"}, `--log-format="xml": want text or json`},
	} {
		line, err := run(t, tc.args...)
		if err == nil {
			t.Errorf("%v: no error", tc.args)
			continue
		}
		if !strings.Contains(line, tc.want) || strings.Contains(line, "\n") {
			t.Errorf("%v: got %q, want one line with %q", tc.args, line, tc.want)
		}
	}
}

// TestHiveCommandWritesNothing: "ipmasq-agent hive" builds the cells to
// print them; it must not create or write the agent's state (IPAM restored
// its state directory in its constructor, so the command created
// /var/lib/ipmasq and an endpoints file on whatever host it ran).
func TestHiveCommandWritesNothing(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state")
	cmd := newRootCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{"hive", "--state-dir=" + state})
	if err := cmd.Execute(); err != nil {
		t.Fatalf("ipmasq-agent hive: %v\n%s", err, out.String())
	}
	if _, err := os.Stat(state); !os.IsNotExist(err) {
		t.Errorf("ipmasq-agent hive created %s (stat: %v)", state, err)
	}
}

func TestFlagsFromEnvironment(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("IPMASQ_BPF_ROOT", dir)
	line, err := run(t)
	if err == nil || !strings.Contains(line, "--bpf-root "+dir) {
		t.Fatalf("IPMASQ_BPF_ROOT not used: %q %v", line, err)
	}
}

func TestHelpListsEveryFlag(t *testing.T) {
	out, err := run(t, "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{
		"--ip-masq-agent-config-path", "--bpf-root", "--enable-ipv4", "--enable-ipv6", "--max-nonmasq-cidrs",
		"--log-level", "--pod-cidr", "--state-dir", "--api-socket", "--egress-route-table", "--ipam-config-wait",
		"--egress-rule-priority", "--devices", "--nat-port-range", "--nat-keep-source-port", "--nat-max-entries", "--nat-gc-interval", "--tc-attach-mode",
		"--prometheus-serve-addr", "--shell-sock-path",
	} {
		if !strings.Contains(out, flag) {
			t.Errorf("--help does not document %s", flag)
		}
	}
}

// TestVersion: --version prints the build's version and starts nothing
// (the variables below would make a start fail).
func TestVersion(t *testing.T) {
	t.Setenv("IPMASQ_BPF_ROOT", t.TempDir())
	out, err := run(t, "--version")
	if err != nil {
		t.Fatalf("--version: %v", err)
	}
	if want := "ipmasq-agent " + buildinfo.String() + "\n"; out != want {
		t.Fatalf("--version printed %q, want %q", out, want)
	}
}

// TestLogFormat: --log-format=json writes one JSON object a line with the
// level, message and fields; text (the default) writes key=value.
func TestLogFormat(t *testing.T) {
	var b bytes.Buffer
	log, err := newLogger(&b, "info", "json")
	if err != nil {
		t.Fatal(err)
	}
	log.Debug("hidden")
	log.Info("Config applied", "generation", 3)
	var rec map[string]any
	if err := json.Unmarshal(b.Bytes(), &rec); err != nil {
		t.Fatalf("json log line %q: %v", b.String(), err)
	}
	if rec["level"] != "INFO" || rec["msg"] != "Config applied" || rec["generation"] != float64(3) {
		t.Fatalf("json log line: %v", rec)
	}
	b.Reset()
	if log, err = newLogger(&b, "info", "text"); err != nil {
		t.Fatal(err)
	}
	log.Info("Config applied", "generation", 3)
	if !strings.Contains(b.String(), `level=INFO msg="Config applied" generation=3`) {
		t.Fatalf("text log line: %q", b.String())
	}
}
