package bpf

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// HandoverResult says what [Datapath.AdoptV4], [Datapath.MarkConntrackV4]
// and their IPv6 forms did: enum nat_handover_result in lib/handover.h.
type HandoverResult uint32

// Results of a handover.
const (
	// HandoverDone: the pair was made (adopt) or marked (mark).
	HandoverDone = HandoverResult(masqNatHandoverResultNAT_HANDOVER_DONE)
	// HandoverExists: adopt found a pair for the flow already; kept as it is.
	HandoverExists = HandoverResult(masqNatHandoverResultNAT_HANDOVER_EXISTS)
	// HandoverTaken: adopt found the translated tuple claimed by another
	// party (a pair being ended or rebuilt at that instant).
	HandoverTaken = HandoverResult(masqNatHandoverResultNAT_HANDOVER_TAKEN)
	// HandoverGone: mark found no whole pair for the flow.
	HandoverGone = HandoverResult(masqNatHandoverResultNAT_HANDOVER_GONE)
	// HandoverFull: adopt found the NAT map full.
	HandoverFull = HandoverResult(masqNatHandoverResultNAT_HANDOVER_FULL)
)

func (r HandoverResult) String() string {
	switch r {
	case HandoverDone:
		return "done"
	case HandoverExists:
		return "exists"
	case HandoverTaken:
		return "taken"
	case HandoverGone:
		return "gone"
	case HandoverFull:
		return "full"
	}
	return fmt.Sprintf("result-%d", uint32(r))
}

// HandoverConntrack is the handover value (NATValV4.Handover of a reply
// entry) of a pair whose translation conntrack may hold: the ingress
// program leaves its replies to conntrack while conntrack has the flow.
const HandoverConntrack = uint8(masqNatHandoverNAT_HANDOVER_CONNTRACK)

// natHandoverCtxV4 is struct nat_handover_v4_ctx.
type natHandoverCtxV4 struct {
	Key    NATKeyV4
	Addr   uint32
	Port   uint16
	Op     uint8
	Seen   uint8
	Result uint32
}

// natHandoverCtxV6 is struct nat_handover_v6_ctx.
type natHandoverCtxV6 struct {
	Key    NATKeyV6
	Addr   [16]byte
	Port   uint16
	Op     uint8
	Seen   uint8
	Result uint32
}

const (
	opAdopt = uint8(masqNatHandoverOpNAT_HANDOVER_ADOPT)
	opMark  = uint8(masqNatHandoverOpNAT_HANDOVER_MARK)
)

// AdoptV4 makes the NAT pair of a flow conntrack translates: k is the
// flow's egress tuple (Dir is set to DirEgress), to:port its translation;
// seen says the remote has answered. The pair is marked as conntrack's
// (lib/handover.h): its replies are left to conntrack while conntrack has
// the flow, and translated here once it does not.
func (d *Datapath) AdoptV4(k NATKeyV4, to netip.Addr, port uint16, seen bool) (HandoverResult, error) {
	if !to.Is4() && !to.Is4In6() {
		return 0, fmt.Errorf("adopt %v: translation %v is not IPv4", k, to)
	}
	ctx := natHandoverCtxV4{Key: k, Addr: Addr4(to), Port: Port(port), Op: opAdopt, Seen: boolU8(seen)}
	return d.runHandover(d.objs.NatHandoverV4, &ctx, &ctx.Result)
}

// AdoptV6 is [Datapath.AdoptV4] for IPv6.
func (d *Datapath) AdoptV6(k NATKeyV6, to netip.Addr, port uint16, seen bool) (HandoverResult, error) {
	if !to.Is6() || to.Is4In6() {
		return 0, fmt.Errorf("adopt %v: translation %v is not IPv6", k, to)
	}
	ctx := natHandoverCtxV6{Key: k, Addr: to.As16(), Port: Port(port), Op: opAdopt, Seen: boolU8(seen)}
	return d.runHandover(d.objs.NatHandoverV6, &ctx, &ctx.Result)
}

// MarkConntrackV4 marks the pair of egress tuple k as handed to conntrack
// (before the caller gives conntrack an entry with its translation).
func (d *Datapath) MarkConntrackV4(k NATKeyV4) (HandoverResult, error) {
	ctx := natHandoverCtxV4{Key: k, Op: opMark}
	return d.runHandover(d.objs.NatHandoverV4, &ctx, &ctx.Result)
}

// MarkConntrackV6 is [Datapath.MarkConntrackV4] for IPv6.
func (d *Datapath) MarkConntrackV6(k NATKeyV6) (HandoverResult, error) {
	ctx := natHandoverCtxV6{Key: k, Op: opMark}
	return d.runHandover(d.objs.NatHandoverV6, &ctx, &ctx.Result)
}

func (d *Datapath) runHandover(prog *ebpf.Program, ctx any, result *uint32) (HandoverResult, error) {
	if err := d.runAgentProgram(prog, ctx, result); err != nil {
		return 0, err
	}
	return HandoverResult(*result), nil
}

// NoteHandBackV4 names, for the egress program, the flow of egress tuple
// k that the caller is about to hand back to conntrack, translated to port
// by its pair (lib/handover.h, "The hand-back's races"): until
// [Datapath.ClearHandBacks], a TCP segment to k's remote that conntrack
// translated, in the instant between the agent's delete and create, to
// another port than port is dropped rather than sent, and so is a reply
// to port while conntrack has no translating entry for it. A later note
// of the same remote replaces this one.
func (d *Datapath) NoteHandBackV4(k NATKeyV4, port uint16) error {
	key := masqHandbackV4Key{Remote: k.Dst, Rport: k.Dport, Proto: k.Proto}
	val := masqHandbackV4Val{Src: k.Src, Sport: k.Sport, Port: Port(port)}
	if err := d.Maps.HandbackV4.Put(&key, &val); err != nil {
		return fmt.Errorf("note the hand-back of %v: %w", k, err)
	}
	return d.setHandBackActive(1)
}

// NoteHandBackV6 is [Datapath.NoteHandBackV4] for IPv6.
func (d *Datapath) NoteHandBackV6(k NATKeyV6, port uint16) error {
	key := masqHandbackV6Key{Remote: k.Dst, Rport: k.Dport, Proto: k.Proto}
	val := masqHandbackV6Val{Src: k.Src, Sport: k.Sport, Port: Port(port)}
	if err := d.Maps.HandbackV6.Put(&key, &val); err != nil {
		return fmt.Errorf("note the hand-back of %v: %w", k, err)
	}
	return d.setHandBackActive(1)
}

// setHandBackActive writes handback_active: non-zero while notes may be
// in handback_v4/v6, so that the egress program looks them up only then.
func (d *Datapath) setHandBackActive(on uint32) error {
	if err := d.Maps.HandbackActive.Put(uint32(0), on); err != nil {
		return fmt.Errorf("write %s: %w", d.Maps.HandbackActive, err)
	}
	return nil
}

// ClearHandBacks removes every note of [Datapath.NoteHandBackV4] and
// [Datapath.NoteHandBackV6].
func (d *Datapath) ClearHandBacks() error {
	if err := d.setHandBackActive(0); err != nil {
		return err
	}
	for _, m := range []*ebpf.Map{d.Maps.HandbackV4, d.Maps.HandbackV6} {
		var keys [][]byte
		var key []byte
		it := m.Iterate()
		for it.Next(&key, new([]byte)) {
			keys = append(keys, bytes.Clone(key))
		}
		if err := it.Err(); err != nil {
			return fmt.Errorf("list %s: %w", m, err)
		}
		for _, k := range keys {
			if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return fmt.Errorf("clear %s: %w", m, err)
			}
		}
	}
	return nil
}

func boolU8(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}

// ConntrackLookupAvailable reports whether the kernel has the conntrack
// kfunc the ingress program asks before translating a pair conntrack may
// hold (bpf_skb_ct_lookup, in vmlinux or the loaded nf_conntrack module).
// Without it the lookup is left out when the programs load, and a pair
// handed to conntrack is translated by both: the handover is then refused
// by the agent.
func ConntrackLookupAvailable() (bool, error) {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return false, fmt.Errorf("read the kernel's BTF: %w", err)
	}
	var fn *btf.Func
	if err := spec.TypeByName("bpf_skb_ct_lookup", &fn); err == nil {
		return true, nil
	} else if !errors.Is(err, btf.ErrNotFound) {
		return false, err
	}
	mod, err := btf.LoadKernelModuleSpec("nf_conntrack")
	if err != nil {
		return false, nil // no such module loaded
	}
	return mod.TypeByName("bpf_skb_ct_lookup", &fn) == nil, nil
}
