package bpf

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// verifierStackLimit is MAX_BPF_STACK: the verifier refuses a program whose
// deepest chain of subprogram calls uses more stack than this.
const verifierStackLimit = 512

// stackDepthLine is the verifier's statistics line (log level
// BPF_LOG_STATS): one stack depth per subprogram, in instruction order.
var stackDepthLine = regexp.MustCompile(`(?m)^stack depth ([0-9+]+)$`)

// stackChain is the deepest call chain of a program as the verifier counts
// it: the sum of each subprogram's stack depth, rounded up to 16 bytes (the
// rule for JIT-compiled programs since 6.6) or to 32 (the interpreter's,
// and every program's before 6.6, a frame of 0 bytes counted as 1).
type stackChain struct {
	bytes  int
	path   []string // entry first, "name(depth)"
	frames []string // every subprogram of the program, "name(depth)", deepest first
}

// TestStackHeadroom measures each program's deepest call chain from the
// verifier's own figures and logs how much of the 512-byte limit it leaves
// free. Run it with -v after a change to the C code:
//
//	go test -count=1 -run TestStackHeadroom -v ./bpf/
//
// It fails when the figures cannot be read (a verifier log without the
// statistics line, subprograms without BTF function names), so that the
// measurement never silently reports nothing, and when a chain counted as
// kernels before 6.6 count it (every frame rounded up to 32 bytes) is over
// the limit: those kernels refuse the program, though this one loads it.
func TestStackHeadroom(t *testing.T) {
	privtest.Require(t)
	f := ProbeKernel()
	for _, v := range []Variant{VariantFull, VariantCompat} {
		t.Run(string(v), func(t *testing.T) {
			// A kernel that lacks what the variant needs (the full one
			// before 5.17) cannot load it to measure it: the agent must
			// refuse it there instead.
			if _, err := ChooseVariant(v, f); err != nil {
				if len(f.MissingFull) == 0 || v == VariantCompat {
					t.Fatalf("kernel %s refuses the %s variant: %v", f.Release, v, err)
				}
				t.Logf("kernel %s cannot run the %s variant (%v): the agent refuses it, nothing to measure", f.Release, v, err)
				return
			}
			testStackHeadroom(t, v)
		})
	}
}

func testStackHeadroom(t *testing.T, v Variant) {
	spec, err := v.spec()
	if err != nil {
		t.Fatal(err)
	}
	if !csumIPv6FlagSupported() {
		if err := spec.Variables["csum_ipv6_flag"].Set(uint64(0)); err != nil {
			t.Fatal(err)
		}
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{
		Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer coll.Close()

	names := make([]string, 0, len(coll.Programs))
	for name := range coll.Programs {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		chain, err := deepestStackChain(coll.Programs[name], 16)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if chain.bytes > verifierStackLimit {
			t.Errorf("%s: computed chain of %d bytes, over the verifier's %d, yet the program loaded: the computation is wrong",
				name, chain.bytes, verifierStackLimit)
		}
		old, err := deepestStackChain(coll.Programs[name], 32)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if old.bytes > verifierStackLimit {
			t.Errorf("%s: chain of %d bytes with frames rounded to 32 (kernels before 6.6 refuse it): %s",
				name, old.bytes, strings.Join(old.path, " -> "))
		}
		t.Logf("%-17s %3d of %d bytes, %3d free: %s", name, chain.bytes, verifierStackLimit,
			verifierStackLimit-chain.bytes, strings.Join(chain.path, " -> "))
		t.Logf("%-17s before 6.6: %3d of %d bytes, %3d free: %s", "", old.bytes, verifierStackLimit,
			verifierStackLimit-old.bytes, strings.Join(old.path, " -> "))
		t.Logf("%-17s subprograms: %s", "", strings.Join(chain.frames, " "))
	}
}

// deepestStackChain reads the per-subprogram stack depths from prog's
// verifier log and the call graph from its translated instructions, each
// frame rounded up to round bytes (16 or 32, see stackChain).
func deepestStackChain(prog *ebpf.Program, round int) (stackChain, error) {
	frame := func(depth int) int {
		if round == 32 {
			return (max(depth, 1) + 31) &^ 31
		}
		return (depth + 15) &^ 15
	}
	m := stackDepthLine.FindStringSubmatch(prog.VerifierLog)
	if m == nil {
		return stackChain{}, fmt.Errorf("no stack depth line in the verifier log:\n%s", prog.VerifierLog)
	}
	var depths []int
	for _, f := range strings.Split(m[1], "+") {
		d, err := strconv.Atoi(f)
		if err != nil {
			return stackChain{}, fmt.Errorf("stack depth line %q: %w", m[0], err)
		}
		depths = append(depths, d)
	}

	info, err := prog.Info()
	if err != nil {
		return stackChain{}, err
	}
	insns, err := info.Instructions()
	if err != nil {
		return stackChain{}, err
	}
	// Subprograms in instruction order, as the verifier numbers them.
	type call struct {
		offset asm.RawInstructionOffset
		index  int
	}
	type subprog struct {
		name  string
		start asm.RawInstructionOffset
		calls []call
	}
	var subs []*subprog
	iter := insns.Iterate()
	for iter.Next() {
		if fn := btf.FuncMetadata(iter.Ins); fn != nil {
			subs = append(subs, &subprog{name: fn.Name, start: iter.Offset})
		}
		if len(subs) == 0 {
			return stackChain{}, fmt.Errorf("instruction %d belongs to no BTF function", iter.Offset)
		}
		if iter.Ins.IsFunctionCall() {
			// Translated after JIT: off holds the relative jump, imm
			// the callee's subprogram index.
			subs[len(subs)-1].calls = append(subs[len(subs)-1].calls, call{
				offset: iter.Offset + asm.RawInstructionOffset(iter.Ins.Offset) + 1,
				index:  int(iter.Ins.Constant),
			})
		}
	}
	if len(subs) != len(depths) {
		return stackChain{}, fmt.Errorf("%d BTF functions, %d stack depths (%q)", len(subs), len(depths), m[0])
	}
	byStart := map[asm.RawInstructionOffset]int{}
	for i, s := range subs {
		byStart[s.start] = i
	}

	memo := map[int]stackChain{}
	var deepest func(i int, seen map[int]bool) (stackChain, error)
	deepest = func(i int, seen map[int]bool) (stackChain, error) {
		if c, ok := memo[i]; ok {
			return c, nil
		}
		if seen[i] {
			return stackChain{}, fmt.Errorf("recursion through %s", subs[i].name)
		}
		seen[i] = true
		defer delete(seen, i)
		var below stackChain
		for _, target := range subs[i].calls {
			j, ok := byStart[target.offset]
			if !ok || j != target.index {
				return stackChain{}, fmt.Errorf("%s calls instruction %d (subprogram %d), the start of no function of that index",
					subs[i].name, target.offset, target.index)
			}
			c, err := deepest(j, seen)
			if err != nil {
				return stackChain{}, err
			}
			if c.bytes > below.bytes || below.path == nil {
				below = c
			}
		}
		own := frame(depths[i])
		c := stackChain{
			bytes: own + below.bytes,
			path:  append([]string{fmt.Sprintf("%s(%d)", subs[i].name, own)}, below.path...),
		}
		memo[i] = c
		return c, nil
	}
	chain, err := deepest(0, map[int]bool{})
	if err != nil {
		return stackChain{}, err
	}
	order := make([]int, len(subs))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return depths[order[a]] > depths[order[b]] })
	for _, i := range order {
		chain.frames = append(chain.frames, fmt.Sprintf("%s(%d)", subs[i].name, frame(depths[i])))
	}
	return chain, nil
}
