package bpf

import (
	"github.com/cilium/ebpf"
)

// GCResult says what [Datapath.EndPairV4] or [Datapath.EndPairV6] did:
// enum nat_gc_result in lib/natgc.h.
type GCResult uint32

// Results of ending a pair.
const (
	// GCKept: the pair has not expired (a packet since the caller's scan,
	// a SYN that reopened it, a flow that took its port over), or another
	// party is ending or rebuilding it: nothing deleted.
	GCKept = GCResult(masqNatGcResultNAT_GC_KEPT)
	// GCEnded: the pair's entries (or the inbound record) deleted.
	GCEnded = GCResult(masqNatGcResultNAT_GC_ENDED)
	// GCGone: no entry at the key.
	GCGone = GCResult(masqNatGcResultNAT_GC_GONE)
)

// natGCCtxV4 is struct nat_gc_v4_ctx.
type natGCCtxV4 struct {
	Key    NATKeyV4
	Force  uint32
	Result uint32
}

// natGCCtxV6 is struct nat_gc_v6_ctx.
type natGCCtxV6 struct {
	Key    NATKeyV6
	Force  uint32
	Result uint32
}

// EndPairV4 ends the IPv4 NAT pair that k is either half of (or the
// inbound record at k) if it has expired under the lifetimes the programs
// apply, judged in the kernel at the time of the call, or whatever its age
// when force is set. It claims the pair as the programs do before deleting
// both halves, so that a pair a SYN reopened or another flow took over
// since the caller read it is never deleted (lib/natgc.h).
func (d *Datapath) EndPairV4(k NATKeyV4, force bool) (GCResult, error) {
	ctx := natGCCtxV4{Key: k, Force: boolU32(force)}
	return d.runGC(d.objs.NatGcV4, &ctx, &ctx.Result)
}

// EndPairV6 is [Datapath.EndPairV4] for IPv6.
func (d *Datapath) EndPairV6(k NATKeyV6, force bool) (GCResult, error) {
	ctx := natGCCtxV6{Key: k, Force: boolU32(force)}
	return d.runGC(d.objs.NatGcV6, &ctx, &ctx.Result)
}

func (d *Datapath) runGC(prog *ebpf.Program, ctx any, result *uint32) (GCResult, error) {
	if err := d.runAgentProgram(prog, ctx, result); err != nil {
		return GCKept, err
	}
	return GCResult(*result), nil
}

func boolU32(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}
