// Package iprulestest holds test doubles of the ip rule reconciler: an
// in-memory iprules.Target. Test tooling only.
package iprulestest

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
)

// MemoryTarget is an in-memory iprules.Target for unprivileged tests.
// Like the kernel it keeps rules of every protocol side by side: it can hold
// foreign rules (AddForeign) to prove that pruning ignores them, and it can
// be made to fail (SetFaulty). It is safe for concurrent use.
type MemoryTarget struct {
	mu     sync.Mutex
	rules  map[memRule]struct{}
	faulty error
}

// memRule is a rule and its protocol: the same selectors with different
// protocols are different rules, as in the kernel.
type memRule struct {
	key      tables.IPRuleKey
	protocol uint8
}

var _ iprules.Target = (*MemoryTarget)(nil)

// NewMemoryTarget returns an empty, healthy MemoryTarget.
func NewMemoryTarget() *MemoryTarget {
	return &MemoryTarget{rules: make(map[memRule]struct{})}
}

// AddForeign installs k with another tool's protocol, as `ip rule add ...
// proto <protocol>` would.
func (m *MemoryTarget) AddForeign(k tables.IPRuleKey, protocol uint8) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.rules[memRule{iprules.Canonical(k), protocol}] = struct{}{}
}

// SetFaulty makes every List, Add and Del fail with err; nil makes the
// target healthy again.
func (m *MemoryTarget) SetFaulty(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.faulty = err
}

// List returns the rules carrying iprules.Protocol.
func (m *MemoryTarget) List() ([]tables.IPRuleKey, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.faulty != nil {
		return nil, fmt.Errorf("list ip rules: %w", m.faulty)
	}
	var keys []tables.IPRuleKey
	for r := range m.rules {
		if r.protocol == iprules.Protocol {
			keys = append(keys, r.key)
		}
	}
	slices.SortFunc(keys, iprules.CompareKeys)
	return keys, nil
}

// Add installs k with Protocol; adding an existing rule is not an error.
func (m *MemoryTarget) Add(k tables.IPRuleKey) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.check(k); err != nil {
		return fmt.Errorf("add ip rule %q: %w", k.String(), err)
	}
	m.rules[memRule{iprules.Canonical(k), iprules.Protocol}] = struct{}{}
	return nil
}

// Del removes k with Protocol; removing an absent rule is not an error.
func (m *MemoryTarget) Del(k tables.IPRuleKey) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.check(k); err != nil {
		return fmt.Errorf("delete ip rule %q: %w", k.String(), err)
	}
	delete(m.rules, memRule{iprules.Canonical(k), iprules.Protocol})
	return nil
}

func (m *MemoryTarget) check(k tables.IPRuleKey) error {
	if m.faulty != nil {
		return m.faulty
	}
	return iprules.Validate(k)
}

// Dump returns every rule, foreign ones included, one per line as
// "priority: from X to Y lookup T proto P", sorted by priority, then from,
// to, table and protocol.
func (m *MemoryTarget) Dump() string {
	m.mu.Lock()
	rules := make([]memRule, 0, len(m.rules))
	for r := range m.rules {
		rules = append(rules, r)
	}
	m.mu.Unlock()
	slices.SortFunc(rules, func(a, b memRule) int {
		if c := iprules.CompareKeys(a.key, b.key); c != 0 {
			return c
		}
		return cmp.Compare(a.protocol, b.protocol)
	})
	var sb strings.Builder
	for _, r := range rules {
		fmt.Fprintf(&sb, "%s proto %d\n", r.key, r.protocol)
	}
	return sb.String()
}
