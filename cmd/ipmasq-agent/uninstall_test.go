package main

import (
	"strings"
	"testing"
)

// TestUninstallInputErrors: a bad variable or a --bpf-root that is no
// BPF filesystem is one clear line, before anything is removed; a flag
// on the command line wins over its variable.
func TestUninstallInputErrors(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("IPMASQ_BPF_ROOT", "/nonexistent-bpffs")
	line, err := run(t, "uninstall", "--bpf-root="+dir)
	if err == nil || !strings.Contains(line, "--bpf-root "+dir+" is not a BPF filesystem") || strings.Contains(line, "\n") {
		t.Errorf("uninstall --bpf-root=%s: %q, want one line saying it is not a BPF filesystem", dir, line)
	}
	t.Setenv("IPMASQ_EGRESS_RULE_PRIORITY", "high")
	line, err = run(t, "uninstall", "--bpf-root="+dir)
	if err == nil || !strings.Contains(line, `IPMASQ_EGRESS_RULE_PRIORITY="high"`) || strings.Contains(line, "\n") {
		t.Errorf("uninstall with IPMASQ_EGRESS_RULE_PRIORITY=high: %q, want one line naming the variable", line)
	}
}
