package datapath

import (
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/bpf"
)

// TestChooseVariantFlag: --datapath-variant picks the build, a bad value is
// an error naming the flag, and a kernel no build runs on is refused at
// construction (the agent exits before anything loads or attaches) with
// its release and what it lacks.
func TestChooseVariantFlag(t *testing.T) {
	cfg := DefaultConfig
	old := bpf.KernelFeatures{Release: "5.10.0-test", MissingFull: []string{"syscall programs (5.14)"}}
	v, err := chooseVariant(cfg, old)
	if err != nil || v.Variant != "compat" || v.AttachMode != AttachAuto || !strings.Contains(v.Reason, "syscall programs") {
		t.Errorf("auto on 5.10: %+v, %v", v, err)
	}
	cfg.DatapathVariant = "compat"
	if v, err := chooseVariant(cfg, bpf.KernelFeatures{Release: "6.12"}); err != nil || v.Variant != "compat" || v.Reason != "forced" {
		t.Errorf("compat forced on 6.12: %+v, %v", v, err)
	}
	cfg.DatapathVariant = "newest"
	if _, err := chooseVariant(cfg, old); err == nil || !strings.Contains(err.Error(), "--datapath-variant") {
		t.Errorf("bad value: %v", err)
	}
	cfg.DatapathVariant = "auto"
	tooOld := bpf.KernelFeatures{Release: "4.19.0-test", MissingCompat: []string{"bpf_skb_cgroup_classid helper (5.10)"},
		MissingFull: []string{"bpf_skb_cgroup_classid helper (5.10)"}}
	if _, err := chooseVariant(cfg, tooOld); err == nil || !strings.Contains(err.Error(), "kernel 4.19.0-test") ||
		!strings.Contains(err.Error(), "bpf_skb_cgroup_classid") {
		t.Errorf("4.19: %v", err)
	}
}
