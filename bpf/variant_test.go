package bpf

import (
	"errors"
	"strings"
	"testing"
)

// TestChooseVariant: auto takes the full variant only where the kernel has
// all it needs, the compat one where it has what that needs, and a kernel
// with neither is one error naming its release and what it lacks; a
// forced variant the kernel cannot take is refused the same way.
func TestChooseVariant(t *testing.T) {
	all := KernelFeatures{Release: "6.12.0-test"}
	old := KernelFeatures{Release: "5.10.0-test", MissingFull: []string{"syscall programs (5.14)"}}
	tooOld := KernelFeatures{Release: "5.4.0-test",
		MissingCompat: []string{"bpf_skb_cgroup_classid helper (5.10)"},
		MissingFull:   []string{"bpf_skb_cgroup_classid helper (5.10)", "syscall programs (5.14)"}}
	noBTF := KernelFeatures{Release: "5.15.0-nobtf",
		MissingCompat: []string{"kernel BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF)"},
		MissingFull:   []string{"kernel BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF)"}}

	for _, c := range []struct {
		want    Variant
		f       KernelFeatures
		got     Variant
		reason  string
		errWant []string
	}{
		{want: VariantAuto, f: all, got: VariantFull, reason: "kernel has every feature"},
		{want: "", f: all, got: VariantFull, reason: "kernel has every feature"},
		{want: VariantAuto, f: old, got: VariantCompat, reason: "kernel lacks syscall programs (5.14)"},
		{want: VariantCompat, f: all, got: VariantCompat, reason: "forced"},
		{want: VariantFull, f: all, got: VariantFull, reason: "forced"},
		{want: VariantFull, f: old, errWant: []string{"kernel 5.10.0-test", "full datapath", "syscall programs (5.14)"}},
		{want: VariantAuto, f: tooOld, errWant: []string{"kernel 5.4.0-test", "Linux 5.10 or later", "missing bpf_skb_cgroup_classid helper (5.10)"}},
		{want: VariantCompat, f: noBTF, errWant: []string{"kernel 5.15.0-nobtf", "kernel BTF"}},
		{want: "fast", f: all, errWant: []string{`"fast"`, "want auto, full or compat"}},
	} {
		got, err := ChooseVariant(c.want, c.f)
		if c.errWant != nil {
			if err == nil {
				t.Errorf("ChooseVariant(%q, %s) = %+v, want an error", c.want, c.f.Release, got)
				continue
			}
			for _, w := range c.errWant {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("ChooseVariant(%q, %s): error %q does not say %q", c.want, c.f.Release, err, w)
				}
			}
			if c.want != "fast" && !errors.Is(err, ErrKernelUnsupported) {
				t.Errorf("ChooseVariant(%q, %s): error %v is not ErrKernelUnsupported", c.want, c.f.Release, err)
			}
			continue
		}
		if err != nil || got.Variant != c.got || got.Reason != c.reason {
			t.Errorf("ChooseVariant(%q, %s) = %+v, %v; want %s (%s)", c.want, c.f.Release, got, err, c.got, c.reason)
		}
	}
}

// TestParseVariant: the values of --datapath-variant, and no other.
func TestParseVariant(t *testing.T) {
	for _, s := range []string{"auto", "full", "compat"} {
		if v, err := ParseVariant(s); err != nil || string(v) != s {
			t.Errorf("ParseVariant(%q) = %q, %v", s, v, err)
		}
	}
	if _, err := ParseVariant("Compat"); err == nil {
		t.Errorf("ParseVariant(Compat): no error")
	}
}
