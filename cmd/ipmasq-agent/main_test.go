package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"
)

// run executes the command line and returns the one line an operator would
// see on failure.
// Every path the agent writes is moved into a temporary directory: the
// hive builds its cells (IPAM restores its state directory) before a start
// hook refuses a bad flag, and a test must not touch the host's
// /var/lib/ipmasq or /run/ipmasq.
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
		"--egress-rule-priority", "--devices", "--nat-port-range", "--nat-max-entries", "--nat-gc-interval", "--tc-attach-mode",
		"--prometheus-serve-addr", "--shell-sock-path",
	} {
		if !strings.Contains(out, flag) {
			t.Errorf("--help does not document %s", flag)
		}
	}
}
