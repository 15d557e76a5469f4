package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// badValues is a value each flag refuses. Numbers, durations and booleans
// that do not parse stand in for flags whose every well-formed value is
// accepted (their cells bound them at use).
var badValues = map[string]string{
	"add_dir_header": "maybe", "alsologtostderr": "maybe", "logtostderr": "maybe", "one_output": "maybe",
	"skip_headers": "maybe", "skip_log_headers": "maybe", "random-fully": "maybe", "version": "maybe",
	"legacy_stderr_threshold_behavior": "maybe", "conntrack-handover": "maybe",
	"enable-ipv4": "maybe", "enable-ipv6": "maybe", "masquerade-pod-cidrs-only": "maybe", "nat-keep-source-port": "maybe", "nat-random-fully": "maybe", "nomasq-all-reserved-ranges": "maybe",
	"ip-masq-agent-v2": "maybe", "resync-interval": "60s",
	"v": "x", "log_file_max_size": "-1", "stderrthreshold": "bogus", "alsologtostderrthreshold": "bogus",
	"vmodule": "main", "log_backtrace_at": "main.go:x",
	"egress-route-table": "x", "egress-rule-priority": "0", "max-nonmasq-cidrs": "0", "nat-max-entries": "x",
	"ipam-config-wait": "x", "nat-gc-interval": "x",
	"nat-timeout-icmp": "0s", "nat-timeout-other": "0s", "nat-timeout-tcp-closing": "0s",
	"nat-timeout-tcp-established": "0s", "nat-timeout-tcp-reset": "0s", "nat-timeout-tcp-syn": "0s",
	"nat-timeout-udp": "0s", "nat-timeout-udp-replied": "0s",
	"nat-port-range": "9-1", "nf-conntrack-max-path": "/", "tc-attach-mode": "xdp", "datapath-variant": "fast", "pod-cidr": "10.0.0.1/8", "cluster-cidr": "x",
	"devices": "eth0,,eth1", "log-level": "loud", "log-format": "yaml", "to-ports": "0",
	"prometheus-serve-addr": "9464", "k8s-kubeconfig-path": "/nonexistent/kubeconfig", "k8s-node-name": "node-1",
	"bpf-root": "", // filled in: a directory that is not a BPF filesystem
}

// alsoBad are more values flags refuse: values that parse but mean nothing
// the agent can run with (an empty path, a zero interval).
var alsoBad = map[string][]string{
	"nat-gc-interval": {"0s", "-1s"}, "ipam-config-wait": {"-1s"},
	"state-dir": {""}, "api-socket": {""}, "ip-masq-agent-config-path": {""},
}

// anyValue are the flags that accept every value (every non-empty one, for
// those in alsoBad): paths the agent creates, and the Kubernetes agent's
// flags that only warn.
var anyValue = map[string]string{
	"api-socket": "a path the agent creates", "state-dir": "a path the agent creates",
	"shell-sock-path": "a path the agent creates (empty: no shell)", "ip-masq-agent-config-path": "a missing file is waited for",
	"masq-chain": "ignored, one warning",
	"log_dir":    "ignored, one warning", "log_file": "ignored, one warning",
	"help": "not a setting",
}

// TestEveryBadFlagIsOneLine runs the real binary once per flag with a bad
// value: stderr must be exactly one line naming the flag, stdout empty,
// exit status 1. A flag added without an entry above fails the test.
func TestEveryBadFlagIsOneLine(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "ipmasq-agent")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	root := newRootCommand()
	root.Flags().VisitAll(func(f *pflag.Flag) { flags.AddFlag(f) })

	private := t.TempDir()
	notBPF := filepath.Join(private, "not-bpffs")
	if err := os.Mkdir(notBPF, 0o700); err != nil {
		t.Fatal(err)
	}
	type badFlag struct{ name, value string }
	var cases []badFlag
	flags.VisitAll(func(f *pflag.Flag) {
		for _, v := range alsoBad[f.Name] {
			cases = append(cases, badFlag{f.Name, v})
		}
		if _, ok := anyValue[f.Name]; ok {
			return
		}
		bad, ok := badValues[f.Name]
		if !ok {
			t.Errorf("--%s has no bad value in badValues (nor a reason in anyValue)", f.Name)
			return
		}
		if f.Name == "bpf-root" {
			bad = notBPF
		}
		cases = append(cases, badFlag{f.Name, bad})
	})
	for _, c := range cases {
		f, bad := flags.Lookup(c.name), c.value
		t.Run(f.Name+"="+bad, func(t *testing.T) {
			// Every path in a private directory, and a --bpf-root that is
			// not a BPF filesystem unless it is the flag under test: a
			// value the agent wrongly accepts ends at the --bpf-root check,
			// a line that does not name the flag, never in a started agent.
			args := []string{"--" + f.Name + "=" + bad}
			if f.Name != "bpf-root" {
				args = append(args, "--bpf-root="+notBPF)
			}
			cmd := exec.Command(bin, args...)
			cmd.Env = append(os.Environ(),
				"IPMASQ_STATE_DIR="+filepath.Join(private, "state"),
				"IPMASQ_API_SOCKET="+filepath.Join(private, "run", "api.sock"),
				"IPMASQ_SHELL_SOCK_PATH="+filepath.Join(private, "run", "shell.sock"),
				"IPMASQ_IP_MASQ_AGENT_CONFIG_PATH="+filepath.Join(private, "config", "ip-masq-agent"),
				"K8S_NODE_NAME=", "KUBERNETES_SERVICE_HOST=")
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			err := cmd.Run()
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 1 {
				t.Fatalf("%v: exit %v, want status 1; stderr:\n%s", args, err, stderr.String())
			}
			lines := strings.Split(strings.TrimSuffix(stderr.String(), "\n"), "\n")
			if len(lines) != 1 || !strings.Contains(lines[0], "--"+f.Name) || stdout.Len() != 0 {
				t.Fatalf("%v: want one line on stderr naming --%s, nothing on stdout; got stderr:\n%s\nstdout:\n%s",
					args, f.Name, stderr.String(), stdout.String())
			}
			t.Log(lines[0])
		})
	}
}
