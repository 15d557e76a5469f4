package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// build compiles pkg into dir and returns the binary's path.
func build(t *testing.T, dir, name, pkg string) string {
	t.Helper()
	bin := filepath.Join(dir, name)
	if out, err := exec.Command("go", "build", "-o", bin, pkg).CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, out)
	}
	return bin
}

// runDemo runs the demo binary with args and returns its output and error.
func runDemo(t *testing.T, demo string, timeout time.Duration, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, demo, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// The demo runs to its end in either attach mode: it waits for the agent
// to report eth0 attached, not for the pinned tcx links only tcx makes.
func TestDemoAttachModes(t *testing.T) {
	privtest.Require(t)
	dir := t.TempDir()
	agent := build(t, dir, "ipmasq-agent", "github.com/ipmasq/ipmasq/cmd/ipmasq-agent")
	demo := build(t, dir, "ipmasq-demo", "github.com/ipmasq/ipmasq/cmd/ipmasq-demo")
	for _, mode := range []string{"auto", "clsact"} {
		t.Run(mode, func(t *testing.T) {
			out, err := runDemo(t, demo, 3*time.Minute, "--agent", agent, "--tc-attach-mode="+mode)
			if err != nil {
				t.Fatalf("demo --tc-attach-mode=%s: %v\n%s", mode, err, out)
			}
			for _, want := range []string{
				"--tc-attach-mode=" + mode,
				"Datapath: attached to eth0 [Done]",
				"Demo done",
			} {
				if !strings.Contains(out, want) {
					t.Errorf("demo --tc-attach-mode=%s: output lacks %q:\n%s", mode, want, out)
				}
			}
			// Both starts (the first and the restart) wait for the report.
			if n := strings.Count(out, "Datapath: attached to eth0 [Done]"); n != 2 {
				t.Errorf("demo --tc-attach-mode=%s: %d reports of eth0 attached, want 2 (start and restart):\n%s", mode, n, out)
			}
		})
	}
}

// An agent that exits at start: the demo says so at once (not after its
// timeout) and prints the end of the agent's log, which has the reason.
func TestDemoPrintsAgentError(t *testing.T) {
	privtest.Require(t)
	dir := t.TempDir()
	demo := build(t, dir, "ipmasq-demo", "github.com/ipmasq/ipmasq/cmd/ipmasq-demo")
	agent := filepath.Join(dir, "failing-agent")
	script := "#!/bin/sh\n" +
		"echo 'level=INFO msg=\"Starting ipmasq-agent\"'\n" +
		"echo 'level=ERROR msg=\"Start failed\" error=\"load datapath: program nat_egress_v4: the verifier says no (sentinel 7f3a)\"'\n" +
		"exit 1\n"
	if err := os.WriteFile(agent, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	out, err := runDemo(t, demo, 2*time.Minute, "--agent", agent, "--timeout", "90s")
	if err == nil {
		t.Fatalf("demo with a failing agent succeeded:\n%s", out)
	}
	if took := time.Since(start); took > 30*time.Second {
		t.Errorf("demo took %v to report the agent's exit; want it at once, not after --timeout", took)
	}
	for _, want := range []string{"the agent exited", "exit status 1", "the verifier says no (sentinel 7f3a)", "the agent log's last lines"} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}

// A bad flag is refused with the flag's name and value.
func TestDemoRejectsBadAttachMode(t *testing.T) {
	dir := t.TempDir()
	demo := build(t, dir, "ipmasq-demo", "github.com/ipmasq/ipmasq/cmd/ipmasq-demo")
	out, err := runDemo(t, demo, time.Minute, "--tc-attach-mode=tc")
	if err == nil || !strings.Contains(out, `--tc-attach-mode="tc": want auto, tcx or clsact`) {
		t.Fatalf("demo --tc-attach-mode=tc: %v, output:\n%s", err, out)
	}
}
