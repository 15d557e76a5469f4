package iprules

import (
	"cmp"
	"fmt"
	"net/netip"

	"github.com/ipmasq/ipmasq/tables"
)

// Protocol is the rtnetlink protocol (RTPROT_*, the "proto" of `ip rule`)
// that marks rules owned by ipmasq. 170 is unassigned: it is neither in the
// kernel's RTPROT_* list nor in iproute2's rt_protos (which ends its
// reserved list at 99 and uses 186-192 for routing daemons), so no other
// tool is expected to use it.
const Protocol = 170

// Target is where rules are written: the kernel (netlink) or memory (tests,
// dry runs). Errors name the operation and the rule, e.g.
// `add ip rule "111: from 10.0.0.5/32 to 10.0.0.0/8 lookup 11": file exists`.
type Target interface {
	// List returns the rules carrying Protocol, both families. Rules that
	// carry Protocol but also a selector or action an IPRuleKey cannot
	// express are left out, so they are never deleted.
	List() ([]tables.IPRuleKey, error)
	// Add installs a rule with Protocol. Adding an existing rule is not an error.
	Add(tables.IPRuleKey) error
	// Del removes the rule with Protocol. Removing an absent rule is not an error.
	Del(tables.IPRuleKey) error
}

// Canonical returns k with host bits cleared, the form the kernel reports a
// rule in, so a desired rule and the listed one compare equal.
func Canonical(k tables.IPRuleKey) tables.IPRuleKey {
	k.From = k.From.Masked()
	k.To = k.To.Masked()
	return k
}

// Validate rejects keys that are not one rule of one family.
func Validate(k tables.IPRuleKey) error {
	switch {
	case !k.From.IsValid():
		return fmt.Errorf("invalid from prefix %q", k.From)
	case !k.To.IsValid():
		return fmt.Errorf("invalid to prefix %q", k.To)
	case k.From.Addr().Is4() != k.To.Addr().Is4():
		return fmt.Errorf("from %s and to %s are of different address families", k.From, k.To)
	case k.Table == 0:
		return fmt.Errorf("table 0 is not a routing table")
	}
	return nil
}

// opError names the failed operation and the rule, as an operator reads it.
func opError(op string, k tables.IPRuleKey, err error) error {
	return fmt.Errorf("%s ip rule %q: %w", op, k.String(), err)
}

// comparePrefix orders prefixes as `ip rule` prints them side by side:
// by address, then by length.
func comparePrefix(a, b netip.Prefix) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return a.Bits() - b.Bits()
}

// CompareKeys orders rules by priority, then from, to and table.
func CompareKeys(a, b tables.IPRuleKey) int {
	if c := cmp.Compare(a.Priority, b.Priority); c != 0 {
		return c
	}
	if c := comparePrefix(a.From, b.From); c != 0 {
		return c
	}
	if c := comparePrefix(a.To, b.To); c != 0 {
		return c
	}
	return cmp.Compare(a.Table, b.Table)
}
