package iprules_test

import (
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
)

// The non-masquerade CIDRs of a typical ENI node, as in the design.
var eniCIDRs = []string{"10.0.0.0/8", "100.64.0.0/10", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"}

func keysOf(rules []*tables.IPRule) []tables.IPRuleKey {
	keys := make([]tables.IPRuleKey, len(rules))
	for i, r := range rules {
		keys[i] = r.Key()
	}
	return keys
}

func sortKeys(keys []tables.IPRuleKey) []tables.IPRuleKey {
	keys = slices.Clone(keys)
	slices.SortFunc(keys, func(a, b tables.IPRuleKey) int { return strings.Compare(a.String(), b.String()) })
	return keys
}

// wantList checks that target lists exactly want, in any order.
func wantList(t *testing.T, target iprules.Target, want ...tables.IPRuleKey) {
	t.Helper()
	got, err := target.List()
	if err != nil {
		t.Fatalf("list: %v", err)
	}
	if g, w := sortKeys(got), sortKeys(want); !slices.Equal(g, w) {
		t.Fatalf("listed rules:\n%v\nwant:\n%v", g, w)
	}
}

func addAll(t *testing.T, target iprules.Target, keys ...tables.IPRuleKey) {
	t.Helper()
	for _, k := range keys {
		if err := target.Add(k); err != nil {
			t.Fatal(err)
		}
	}
}

// kernelRule is the netlink form of k with another protocol, as another
// tool would install it.
func kernelRule(k tables.IPRuleKey, protocol uint8) *netlink.Rule {
	r := netlink.NewRule()
	r.Priority = int(k.Priority)
	r.Table = int(k.Table)
	r.Protocol = protocol
	r.Family = unix.AF_INET
	if k.From.Addr().Is6() {
		r.Family = unix.AF_INET6
	}
	ipnet := func(p netip.Prefix) *net.IPNet {
		if p.Bits() == 0 {
			return nil
		}
		return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
	}
	r.Src, r.Dst = ipnet(k.From), ipnet(k.To)
	return r
}

// countRules returns how many rules of any protocol the namespace holds.
func countRules(t *testing.T, h *netlink.Handle) int {
	t.Helper()
	n := 0
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := h.RuleList(family)
		if err != nil {
			t.Fatal(err)
		}
		n += len(rules)
	}
	return n
}

func TestNetlinkIPv4(t *testing.T) {
	ns := newNetns(t, false)
	target := iprules.NewNetlinkTarget(ns.Handle)
	want := keysOf(product([]string{"10.112.49.248/32"}, eniCIDRs))

	// A fresh namespace has only the kernel's rules, none of them ours.
	wantList(t, target)
	addAll(t, target, want...)
	wantList(t, target, want...)
}

func TestNetlinkIPv6AndAll(t *testing.T) {
	ns := newNetns(t, false)
	target := iprules.NewNetlinkTarget(ns.Handle)
	want := []tables.IPRuleKey{
		key("fd00::5/128", "fd00::/8"),
		key("2001:db8::1/128", "fe80::/10"),
		key("::/0", "fd00::/8"),
		key("2001:db8::1/128", "::/0"),
		key("0.0.0.0/0", "10.0.0.0/8"),
		key("10.0.0.5/32", "0.0.0.0/0"),
		{Priority: 40000, From: netip.MustParsePrefix("10.0.0.5/32"), To: netip.MustParsePrefix("10.0.0.0/8"), Table: 1000},
	}
	addAll(t, target, want...)
	wantList(t, target, want...)

	// Host bits are cleared, as the kernel reports them.
	if err := target.Del(key("fd00::5/128", "fd00::1/8")); err != nil {
		t.Fatal(err)
	}
	wantList(t, target, want[1:]...)
}

func TestNetlinkAddDelIdempotent(t *testing.T) {
	ns := newNetns(t, false)
	target := iprules.NewNetlinkTarget(ns.Handle)
	k := key("10.112.49.248/32", "10.0.0.0/8")

	addAll(t, target, k, k)
	wantList(t, target, k)
	for range 2 {
		if err := target.Del(k); err != nil {
			t.Fatalf("delete: %v", err)
		}
	}
	wantList(t, target)
	if err := target.Del(key("fd00::5/128", "fd00::/8")); err != nil {
		t.Fatalf("delete of a rule never added: %v", err)
	}
}

func TestNetlinkErrorsNameTheRule(t *testing.T) {
	ns := newNetns(t, false)
	target := iprules.NewNetlinkTarget(ns.Handle)
	err := target.Add(key("10.0.0.5/32", "fd00::/8"))
	const want = `add ip rule "111: from 10.0.0.5/32 to fd00::/8 lookup 11": `
	if err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("add of a mixed-family rule = %v, want prefix %q", err, want)
	}
}

func TestNetlinkForeignRules(t *testing.T) {
	ns := newNetns(t, false)
	target := iprules.NewNetlinkTarget(ns.Handle)
	shared := key("10.112.49.248/32", "10.0.0.0/8")
	other := key("10.112.49.249/32", "10.0.0.0/8")

	// Another tool's rules: the same priority and selectors as ours with
	// protocols boot and static, and one of its own.
	for _, r := range []*netlink.Rule{
		kernelRule(shared, unix.RTPROT_BOOT),
		kernelRule(shared, unix.RTPROT_STATIC),
		kernelRule(other, unix.RTPROT_STATIC),
	} {
		if err := ns.Handle.RuleAdd(r); err != nil {
			t.Fatalf("add foreign rule %s: %v", r, err)
		}
	}
	// A rule with our protocol but a selector a key cannot express (an
	// input interface): not ours to manage, so never listed nor deleted.
	withIif := kernelRule(key("10.112.49.250/32", "10.0.0.0/8"), iprules.Protocol)
	withIif.IifName = "lo"
	if err := ns.Handle.RuleAdd(withIif); err != nil {
		t.Fatalf("add rule with iif: %v", err)
	}
	wantList(t, target)
	base := countRules(t, ns.Handle)

	// Ours coexists with the foreign rules of the same selectors.
	addAll(t, target, shared)
	wantList(t, target, shared)
	if got := countRules(t, ns.Handle); got != base+1 {
		t.Fatalf("%d rules after adding ours, want %d", got, base+1)
	}

	// Deleting ours, twice, and deleting an absent owned twin of the
	// foreign rule leave every foreign rule in place.
	for _, k := range []tables.IPRuleKey{shared, shared, other} {
		if err := target.Del(k); err != nil {
			t.Fatal(err)
		}
	}
	wantList(t, target)
	if got := countRules(t, ns.Handle); got != base {
		t.Fatalf("%d rules after deleting ours, want %d", got, base)
	}

	// Pruning to nothing deletes nothing that is not ours.
	addAll(t, target, shared)
	ops := iprules.NewOps(target)
	prune(t, ops)
	wantStats(t, ops, iprules.Stats{Deletes: 1})
	if got := countRules(t, ns.Handle); got != base {
		t.Fatalf("%d rules after prune, want %d", got, base)
	}
}

func TestNetlinkOpsPrune(t *testing.T) {
	ns := newNetns(t, false)
	target := iprules.NewNetlinkTarget(ns.Handle)
	endpoints := []string{"10.112.49.248/32", "10.112.49.249/32"}
	old := product(endpoints, eniCIDRs)
	cidrs := append(slices.Clone(eniCIDRs[:4]), "198.18.0.0/15")
	cidrs6 := []string{"fd00::/8"}
	want := append(product(endpoints, cidrs), product([]string{"fd00::5/128"}, cidrs6)...)

	// A previous agent's rules.
	addAll(t, target, keysOf(old)...)

	// 1. The first prune writes only the delta: per endpoint one CIDR
	// replaced, plus the IPv6 rule.
	ops := iprules.NewOps(target)
	prune(t, ops, want...)
	update(t, ops, want...)
	wantStats(t, ops, iprules.Stats{Rules: len(want), Adds: 3, Deletes: 2})
	wantList(t, target, keysOf(want)...)

	// 2. A rule deleted behind the agent's back is restored by the next prune.
	if err := ns.Handle.RuleDel(kernelRule(want[0].Key(), iprules.Protocol)); err != nil {
		t.Fatal(err)
	}
	prune(t, ops, want...)
	wantStats(t, ops, iprules.Stats{Rules: len(want), Adds: 4, Deletes: 2})
	wantList(t, target, keysOf(want)...)

	// 3. Restart over a kernel that is right: no writes.
	again := iprules.NewOps(target)
	prune(t, again, want...)
	update(t, again, want...)
	wantStats(t, again, iprules.Stats{Rules: len(want)})
}

// A zero-length prefix is sent as no selector, which the kernel's duplicate
// check and delete search treat as "any": the target must still add and
// delete exactly the rule asked for.
func TestNetlinkZeroLengthPrefixes(t *testing.T) {
	ns := newNetns(t, false)
	target := iprules.NewNetlinkTarget(ns.Handle)
	specific := key("10.0.0.5/32", "10.0.0.0/8")
	toAll := key("10.0.0.5/32", "0.0.0.0/0")
	fromAll := key("0.0.0.0/0", "10.0.0.0/8")
	v6 := key("fd00::5/128", "fd00::/8")
	v6ToAll := key("fd00::5/128", "::/0")
	if err := ns.Handle.RuleAdd(kernelRule(specific, unix.RTPROT_STATIC)); err != nil {
		t.Fatal(err)
	}
	base := countRules(t, ns.Handle)

	// 1. The wildcard rules are added after the specific ones they cover.
	addAll(t, target, specific, v6, toAll, fromAll, v6ToAll, toAll)
	wantList(t, target, specific, toAll, fromAll, v6, v6ToAll)

	// 2. Deleting a wildcard rule deletes that rule, not the specific one
	// the kernel finds first.
	for _, k := range []tables.IPRuleKey{toAll, v6ToAll, toAll} {
		if err := target.Del(k); err != nil {
			t.Fatal(err)
		}
	}
	wantList(t, target, specific, fromAll, v6)
	if err := target.Del(fromAll); err != nil {
		t.Fatal(err)
	}
	wantList(t, target, specific, v6)
	if got := countRules(t, ns.Handle); got != base+2 {
		t.Fatalf("%d rules, want %d: the foreign rule must stay", got, base+2)
	}

	// 3. A rule with our protocol and other selectors that the kernel would
	// delete instead is never deleted: the delete fails and says why.
	withIif := kernelRule(key("10.0.0.9/32", "10.0.0.0/8"), iprules.Protocol)
	withIif.IifName = "lo"
	if err := ns.Handle.RuleAdd(withIif); err != nil {
		t.Fatal(err)
	}
	blocked := key("10.0.0.9/32", "0.0.0.0/0")
	addAll(t, target, blocked)
	err := target.Del(blocked)
	if err == nil || !strings.Contains(err.Error(), "other selectors") {
		t.Fatalf("delete behind a rule with iif = %v, want an error", err)
	}
	wantList(t, target, specific, v6, blocked)
}
