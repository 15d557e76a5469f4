package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"
)

// Variant is one build of the datapath's object (lib/compat.h): the same
// sources, the same decisions and NAT guarantees, for different kernels.
type Variant string

const (
	// VariantFull is masq.c as written (masq_bpfel.o): SEC("syscall")
	// programs for the agent, the CPU's atomics. Linux 5.14+.
	VariantFull Variant = "full"
	// VariantCompat is masq.c built with -DIPMASQ_COMPAT
	// (masqcompat_bpfel.o): the agent's programs are tc programs, the
	// atomics take a bpf_spin_lock. Linux 5.10+.
	VariantCompat Variant = "compat"
	// VariantAuto picks the full variant where the kernel can take it,
	// else the compat one ([ChooseVariant]).
	VariantAuto Variant = "auto"
)

// MinKernel is the oldest kernel the compat variant is made and tested
// for.
const MinKernel = "5.10"

// ParseVariant parses a --datapath-variant value.
func ParseVariant(s string) (Variant, error) {
	switch v := Variant(s); v {
	case VariantAuto, VariantFull, VariantCompat:
		return v, nil
	}
	return "", fmt.Errorf("datapath variant %q: want auto, full or compat", s)
}

// spec is the variant's object.
func (v Variant) spec() (*ebpf.CollectionSpec, error) {
	switch v {
	case VariantFull:
		return loadMasq()
	case VariantCompat:
		return loadMasqcompat()
	}
	return nil, fmt.Errorf("datapath variant %q: want full or compat", v)
}

// KernelFeatures are what the running kernel offers the variants, from
// [ProbeKernel].
type KernelFeatures struct {
	// Release is the kernel's release (uname -r).
	Release string
	// Missing are what each variant needs and the kernel lacks, named for
	// the error and the status ("syscall programs (5.14)").
	MissingFull, MissingCompat []string
}

// feature is one probe: what a variant needs and the kernel that brought it.
type feature struct {
	name  string
	probe func() error
}

// compatNeeds is what both variants need: the compat one needs only this.
var compatNeeds = []feature{
	{"kernel BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF)", func() error {
		_, err := btf.LoadKernelSpec()
		return err
	}},
	{"tc (sched_cls) programs", func() error { return features.HaveProgramType(ebpf.SchedCLS) }},
	{"bounded loops (5.3)", features.HaveBoundedLoops},
	{"bpf_spin_lock helper (5.1)", helper(asm.FnSpinLock)},
	{"bpf_skc_lookup_tcp helper (5.2)", helper(asm.FnSkcLookupTcp)},
	{"bpf_fib_lookup helper (4.18)", helper(asm.FnFibLookup)},
	// 5.10 is the minimum the object is tested on: the last helper the
	// compat build calls that came with it.
	{"bpf_skb_cgroup_classid helper (5.10)", helper(asm.FnSkbCgroupClassid)},
}

// fullNeeds is what the full variant needs besides compatNeeds. Syscall
// programs (5.14) imply the atomics' compare-and-swap and global functions
// that take pointers (5.12).
var fullNeeds = []feature{
	{"syscall programs (5.14)", func() error { return features.HaveProgramType(ebpf.Syscall) }},
	{"bpf_ktime_get_coarse_ns helper (5.11)", helper(asm.FnKtimeGetCoarseNs)},
}

// setCompatClock sets the compat variant's compat_coarse_clock where the
// kernel has bpf_ktime_get_coarse_ns (5.11): its records then take the
// full variant's clock, at half the cost of bpf_ktime_get_ns; on 5.10 the
// verifier drops the call (lib/compat.h). The full variant always has it.
func setCompatClock(v Variant, spec *ebpf.CollectionSpec) error {
	if v != VariantCompat || !hasCoarseClock() {
		return nil
	}
	if err := spec.Variables["compat_coarse_clock"].Set(uint32(1)); err != nil {
		return fmt.Errorf("set compat_coarse_clock: %w", err)
	}
	return nil
}

// hasCoarseClock says whether the kernel has bpf_ktime_get_coarse_ns.
func hasCoarseClock() bool {
	return helper(asm.FnKtimeGetCoarseNs)() == nil
}

func helper(fn asm.BuiltinFunc) func() error {
	return func() error { return features.HaveProgramHelper(ebpf.SchedCLS, fn) }
}

// ProbeKernel asks the running kernel what the variants need.
func ProbeKernel() KernelFeatures {
	f := KernelFeatures{Release: kernelRelease()}
	f.MissingCompat = missing(compatNeeds)
	f.MissingFull = append(append([]string(nil), f.MissingCompat...), missing(fullNeeds)...)
	return f
}

func missing(needs []feature) []string {
	var out []string
	for _, n := range needs {
		switch err := n.probe(); {
		case err == nil:
		case errors.Is(err, ebpf.ErrNotSupported) || errors.Is(err, btf.ErrNotSupported):
			out = append(out, n.name)
		default:
			// Not an answer (no privilege to load a probe, ...): named
			// with the error, so that the refusal says why.
			out = append(out, fmt.Sprintf("%s (probe failed: %v)", n.name, err))
		}
	}
	return out
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "(unknown)"
	}
	return unix.ByteSliceToString(u.Release[:])
}

// VariantChoice is the variant the agent runs and why.
type VariantChoice struct {
	Variant Variant
	// Reason says why, for the status, the start log and the metric.
	Reason string
}

// ErrKernelUnsupported is the error of [ChooseVariant] for a kernel no
// variant can run on.
var ErrKernelUnsupported = errors.New("kernel not supported")

// ChooseVariant picks the variant for want (auto, full or compat) on a
// kernel with features f: auto takes the full variant where the kernel
// has what it needs, else the compat one. A kernel that lacks what the
// chosen variant needs is an error naming its release and what it lacks.
func ChooseVariant(want Variant, f KernelFeatures) (VariantChoice, error) {
	unsupported := func(v Variant, miss []string) error {
		return fmt.Errorf("%w: kernel %s cannot run the %s datapath (Linux %s or later with BTF): missing %s",
			ErrKernelUnsupported, f.Release, v, MinKernel, strings.Join(miss, ", "))
	}
	switch want {
	case VariantFull:
		if len(f.MissingFull) > 0 {
			return VariantChoice{}, unsupported(VariantFull, f.MissingFull)
		}
		return VariantChoice{VariantFull, "forced"}, nil
	case VariantCompat:
		if len(f.MissingCompat) > 0 {
			return VariantChoice{}, unsupported(VariantCompat, f.MissingCompat)
		}
		return VariantChoice{VariantCompat, "forced"}, nil
	case VariantAuto, "":
		if len(f.MissingCompat) > 0 {
			return VariantChoice{}, unsupported(VariantCompat, f.MissingCompat)
		}
		if len(f.MissingFull) == 0 {
			return VariantChoice{VariantFull, "kernel has every feature"}, nil
		}
		return VariantChoice{VariantCompat, "kernel lacks " + strings.Join(f.MissingFull, ", ")}, nil
	}
	_, err := ParseVariant(string(want))
	return VariantChoice{}, err
}

// runAgentProgram runs one of the agent's programs (masq.c's AGENT_RUN)
// on ctx, a struct whose last field is the uint32 *result, and stores the
// program's result there: the full variant's SEC("syscall") program reads
// and writes ctx itself; the compat variant's tc program reads it as its
// packet and returns the result.
func (d *Datapath) runAgentProgram(prog *ebpf.Program, ctx any, result *uint32) error {
	if d.Variant != VariantCompat {
		if _, err := prog.Run(&ebpf.RunOptions{Context: ctx, ContextOut: ctx}); err != nil {
			return fmt.Errorf("run %s: %w", prog, err)
		}
		return nil
	}
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.NativeEndian, ctx); err != nil {
		return fmt.Errorf("run %s: %w", prog, err)
	}
	ret, err := prog.Run(&ebpf.RunOptions{Data: buf.Bytes()})
	if err != nil {
		return fmt.Errorf("run %s: %w", prog, err)
	}
	if ret == agentRunBadInput {
		return fmt.Errorf("run %s: the program read no context from %d bytes", prog, buf.Len())
	}
	*result = ret
	return nil
}

// agentRunBadInput is AGENT_RUN_BAD_INPUT of lib/compat.h.
const agentRunBadInput = 0xffffffff

// testVariant, set by the package's tests (IPMASQ_TEST_DATAPATH_VARIANT,
// testmain_test.go), is the variant [Load] uses for an empty
// LoadOptions.Variant: the tests run the compat variant where the kernel
// has the full one.
var testVariant Variant

// ProbeKernelRelease is the running kernel's release (uname -r).
func ProbeKernelRelease() string { return kernelRelease() }
