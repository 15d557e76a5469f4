package iprules

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
)

// dumpAttempts bounds the retries of a rule dump that the kernel interrupted
// because the rules changed under it; an incomplete list must not be used.
const dumpAttempts = 5

type netlinkTarget struct {
	h *netlink.Handle
	// pipe pipelines batched writes; nil: one request and ack at a time.
	pipe *pipe
}

// NewNetlinkTarget returns a Target that writes the kernel's rules through h,
// which may be bound to another network namespace (netlink.NewHandleAt), one
// request at a time. A nil h uses the network namespace of the calling
// thread.
func NewNetlinkTarget(h *netlink.Handle) Target {
	if h == nil {
		h = &netlink.Handle{}
	}
	return &netlinkTarget{h: h}
}

// NetlinkTarget is the kernel's Target with batched writes: AddBatch and
// DelBatch send their requests back to back on one socket, then collect the
// acks. Close releases its sockets.
type NetlinkTarget interface {
	BatchTarget
	Close() error
}

// NewNetlinkTargetAt returns a Target that writes the rules of network
// namespace ns (netns.None(): the calling thread's) with batched writes.
func NewNetlinkTargetAt(ns netns.NsHandle) (NetlinkTarget, error) {
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("open netlink handle: %w", err)
	}
	p, err := openPipe(ns)
	if err != nil {
		h.Close()
		return nil, err
	}
	return &netlinkTarget{h: h, pipe: p}, nil
}

// Close releases the target's sockets.
func (t *netlinkTarget) Close() error {
	if t.pipe != nil {
		t.pipe.s.Close()
	}
	t.h.Close()
	return nil
}

// List dumps both families and keeps the rules with Protocol.
// netlink v1.3.1 ignores RT_FILTER_PROTOCOL for rules, so the filtering is
// done here.
func (t *netlinkTarget) List() ([]tables.IPRuleKey, error) {
	var keys []tables.IPRuleKey
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := t.dump(family)
		if err != nil {
			return nil, fmt.Errorf("list ip rules (family %d): %w", family, err)
		}
		for i := range rules {
			if k, ok := fromRule(&rules[i]); ok {
				keys = append(keys, k)
			}
		}
	}
	return keys, nil
}

func (t *netlinkTarget) dump(family int) ([]netlink.Rule, error) {
	var err error
	for range dumpAttempts {
		var rules []netlink.Rule
		rules, err = t.h.RuleList(family)
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return rules, err
		}
	}
	return nil, err
}

// Add installs k with Protocol; a rule that already exists is success.
func (t *netlinkTarget) Add(k tables.IPRuleKey) error {
	r, err := toRule(k)
	if err == nil {
		err = t.h.RuleAdd(r)
		if errors.Is(err, unix.EEXIST) {
			err = nil
			if wildcard(k) {
				err = t.addWildcard(Canonical(k), r)
			}
		}
	}
	if err != nil {
		return opError("add", k, err)
	}
	return nil
}

// Del removes k with Protocol; the kernel matches the protocol too, so a
// rule with the same selectors but another protocol stays. An absent rule
// is success.
func (t *netlinkTarget) Del(k tables.IPRuleKey) error {
	r, err := toRule(k)
	if err == nil {
		if wildcard(k) {
			err = t.delWildcard(Canonical(k), r)
		} else {
			err = t.h.RuleDel(r)
		}
	}
	if err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) {
		return opError("delete", k, err)
	}
	return nil
}

// wildcard reports whether k has a zero-length prefix. Such a selector is
// sent as no selector at all, and the kernel's lookups (the NLM_F_EXCL
// duplicate check on add, the search on delete) treat a missing selector
// as "any": "111: from 10.0.0.5/32 to 0.0.0.0/0 lookup 11" is taken for an
// existing "111: from 10.0.0.5/32 to 10.0.0.0/8 lookup 11", and deleting it
// would delete whichever of the two comes first.
func wildcard(k tables.IPRuleKey) bool {
	return k.From.Bits() == 0 || k.To.Bits() == 0
}

// covers reports whether the kernel's lookup for wildcard key k matches
// the listed rule r: same protocol, priority and table, and equal selectors
// where k has one. Selectors k cannot express (iif, mark, ...) are
// wildcards too.
func covers(k tables.IPRuleKey, r *netlink.Rule) bool {
	if r.Protocol != Protocol || r.Priority != int(k.Priority) || r.Table != int(k.Table) {
		return false
	}
	from, ok1 := prefix(r.Family, r.Src)
	to, ok2 := prefix(r.Family, r.Dst)
	return ok1 && ok2 &&
		(k.From.Bits() == 0 || from == k.From) &&
		(k.To.Bits() == 0 || to == k.To)
}

// addWildcard completes an add of wildcard key k that the kernel refused
// as a duplicate: if k itself is not there, the owned rules that k covers
// are set aside while k is added.
func (t *netlinkTarget) addWildcard(k tables.IPRuleKey, r *netlink.Rule) error {
	rules, err := t.dump(r.Family)
	if err != nil {
		return fmt.Errorf("list ip rules: %w", err)
	}
	var covered []*netlink.Rule
	for i := range rules {
		rk, ok := fromRule(&rules[i])
		switch {
		case ok && rk == k:
			return nil
		case ok && covers(k, &rules[i]):
			cr, _ := toRule(rk)
			covered = append(covered, cr)
		}
	}
	if len(covered) == 0 {
		return fmt.Errorf("the kernel reports a matching rule but lists none: %w", unix.EEXIST)
	}
	return t.aside(covered, func() error { return t.h.RuleAdd(r) })
}

// delWildcard deletes wildcard key k exactly: the owned rules that k
// covers and that come before it in the kernel's list are set aside, so
// the kernel's search finds k first.
func (t *netlinkTarget) delWildcard(k tables.IPRuleKey, r *netlink.Rule) error {
	rules, err := t.dump(r.Family)
	if err != nil {
		return fmt.Errorf("list ip rules: %w", err)
	}
	var before []*netlink.Rule
	for i := range rules {
		rk, ok := fromRule(&rules[i])
		switch {
		case ok && rk == k:
			if len(before) == 0 {
				return t.h.RuleDel(r)
			}
			return t.aside(before, func() error { return t.h.RuleDel(r) })
		case !covers(k, &rules[i]):
		case !ok:
			return fmt.Errorf("the kernel would delete %s (protocol %d, with other selectors) instead", rules[i], Protocol)
		default:
			cr, _ := toRule(rk)
			before = append(before, cr)
		}
	}
	return nil // absent
}

// aside deletes rules, runs op and adds them back. The rules set aside are
// covered by the wildcard rule op adds or deletes and use the same table,
// so their traffic is routed the same way except between a wildcard delete
// and their re-adding.
func (t *netlinkTarget) aside(rules []*netlink.Rule, op func() error) error {
	var errs []error
	var removed []*netlink.Rule
	for _, r := range rules {
		if err := t.h.RuleDel(r); err != nil {
			errs = append(errs, fmt.Errorf("set aside %s: %w", r, err))
			break
		}
		removed = append(removed, r)
	}
	if len(errs) == 0 {
		errs = append(errs, op())
	}
	for _, r := range removed {
		if err := t.h.RuleAdd(r); err != nil && !errors.Is(err, unix.EEXIST) {
			errs = append(errs, fmt.Errorf("restore %s: %w", r, err))
		}
	}
	return errors.Join(errs...)
}

// toRule builds the netlink rule for k. A zero-length prefix leaves the
// selector out, which is how the kernel stores and reports "from all".
func toRule(k tables.IPRuleKey) (*netlink.Rule, error) {
	if err := Validate(k); err != nil {
		return nil, err
	}
	k = Canonical(k)
	r := netlink.NewRule()
	r.Priority = int(k.Priority)
	r.Table = int(k.Table)
	r.Protocol = Protocol
	r.Family = unix.AF_INET6
	if k.From.Addr().Is4() {
		r.Family = unix.AF_INET
	}
	r.Src = ipNet(k.From)
	r.Dst = ipNet(k.To)
	return r, nil
}

func ipNet(p netip.Prefix) *net.IPNet {
	if p.Bits() == 0 {
		return nil
	}
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// fromRule converts a listed rule back into its key. It reports false for
// rules that are not ours or that carry anything a key cannot express
// (interface, mark, tos, ports, uid range, goto, non-lookup actions, ...):
// such a rule is not one this package made, and treating it as the plain
// rule would let a prune delete it.
func fromRule(r *netlink.Rule) (tables.IPRuleKey, bool) {
	if r.Protocol != Protocol || (r.Family != unix.AF_INET && r.Family != unix.AF_INET6) {
		return tables.IPRuleKey{}, false
	}
	extra := r.Invert || r.Tos != 0 || r.Mark != 0 || r.Mask != nil || r.TunID != 0 ||
		r.Goto != -1 || r.Flow != -1 || r.IifName != "" || r.OifName != "" ||
		r.SuppressIfgroup != -1 || r.SuppressPrefixlen != -1 ||
		r.Dport != nil || r.Sport != nil || r.IPProto != 0 || r.UIDRange != nil ||
		r.Table <= 0 || r.Priority < 0
	if extra {
		return tables.IPRuleKey{}, false
	}
	from, ok1 := prefix(r.Family, r.Src)
	to, ok2 := prefix(r.Family, r.Dst)
	if !ok1 || !ok2 {
		return tables.IPRuleKey{}, false
	}
	return tables.IPRuleKey{
		Priority: uint32(r.Priority),
		From:     from,
		To:       to,
		Table:    uint32(r.Table),
	}, true
}

// prefix converts a listed selector; nil is the family's zero-length prefix.
func prefix(family int, n *net.IPNet) (netip.Prefix, bool) {
	if n == nil {
		if family == unix.AF_INET {
			return netip.PrefixFrom(netip.IPv4Unspecified(), 0), true
		}
		return netip.PrefixFrom(netip.IPv6Unspecified(), 0), true
	}
	addr, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	if family == unix.AF_INET {
		addr = addr.Unmap()
	}
	if addr.Is4() != (family == unix.AF_INET) {
		return netip.Prefix{}, false
	}
	bits, _ := n.Mask.Size()
	return netip.PrefixFrom(addr, bits).Masked(), true
}
