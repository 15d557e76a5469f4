package iprules_test

import (
	"context"
	"errors"
	"iter"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/cilium/statedb"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/iprulestest"
)

// rule parses "from to" into a priority 111 rule with table 11, the shape
// the rules controller produces.
func rule(from, to string) *tables.IPRule {
	return &tables.IPRule{
		Priority: 111,
		From:     netip.MustParsePrefix(from),
		To:       netip.MustParsePrefix(to),
		Table:    11,
	}
}

func key(from, to string) tables.IPRuleKey { return rule(from, to).Key() }

// desired iterates rules as the reconciler hands them to Prune.
func desired(rules ...*tables.IPRule) iter.Seq2[*tables.IPRule, statedb.Revision] {
	return func(yield func(*tables.IPRule, statedb.Revision) bool) {
		for i, r := range rules {
			if !yield(r, statedb.Revision(i+1)) {
				return
			}
		}
	}
}

// product returns one rule per endpoint and CIDR.
func product(endpoints, cidrs []string) []*tables.IPRule {
	var rules []*tables.IPRule
	for _, ep := range endpoints {
		for _, c := range cidrs {
			rules = append(rules, rule(ep, c))
		}
	}
	return rules
}

func update(t *testing.T, ops *iprules.Ops, rules ...*tables.IPRule) {
	t.Helper()
	for _, r := range rules {
		if err := ops.Update(context.Background(), nil, 0, r); err != nil {
			t.Fatalf("update %s: %v", r.Key(), err)
		}
	}
}

func del(t *testing.T, ops *iprules.Ops, rules ...*tables.IPRule) {
	t.Helper()
	for _, r := range rules {
		if err := ops.Delete(context.Background(), nil, 0, r); err != nil {
			t.Fatalf("delete %s: %v", r.Key(), err)
		}
	}
}

func prune(t *testing.T, ops *iprules.Ops, rules ...*tables.IPRule) {
	t.Helper()
	if err := ops.Prune(context.Background(), nil, desired(rules...)); err != nil {
		t.Fatalf("prune: %v", err)
	}
}

func wantStats(t *testing.T, ops *iprules.Ops, want iprules.Stats) {
	t.Helper()
	if got := ops.Stats(); got != want {
		t.Fatalf("stats = %+v, want %+v", got, want)
	}
}

func wantDump(t *testing.T, m *iprulestest.MemoryTarget, lines ...string) {
	t.Helper()
	want := ""
	for _, l := range lines {
		want += l + "\n"
	}
	if got := m.Dump(); got != want {
		t.Fatalf("rules:\n%s\nwant:\n%s", got, want)
	}
}

func TestOpsUpdateDelete(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	ops := iprules.NewOps(m)
	a := rule("10.0.0.5/32", "10.0.0.0/8")
	b := rule("10.0.0.5/32", "192.168.0.0/16")
	c := rule("fd00::5/128", "fd00::/8")

	// 1. Three new rules cost three writes.
	update(t, ops, a, b, c)
	wantStats(t, ops, iprules.Stats{Rules: 3, Adds: 3})

	// 2. Updating them again (a full reconciliation round) costs none.
	update(t, ops, a, b, c)
	wantStats(t, ops, iprules.Stats{Rules: 3, Adds: 3})
	wantDump(t, m,
		"111: from 10.0.0.5/32 to 10.0.0.0/8 lookup 11 proto 170",
		"111: from 10.0.0.5/32 to 192.168.0.0/16 lookup 11 proto 170",
		"111: from fd00::5/128 to fd00::/8 lookup 11 proto 170",
	)

	// 3. Deleting costs one write, deleting again or deleting a rule that
	// was never there costs none.
	del(t, ops, b)
	del(t, ops, b, rule("10.9.9.9/32", "10.0.0.0/8"))
	wantStats(t, ops, iprules.Stats{Rules: 2, Adds: 3, Deletes: 1})
	wantDump(t, m,
		"111: from 10.0.0.5/32 to 10.0.0.0/8 lookup 11 proto 170",
		"111: from fd00::5/128 to fd00::/8 lookup 11 proto 170",
	)
}

func TestOpsHostBitsAreMasked(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	ops := iprules.NewOps(m)
	// The kernel matches and reports 10.0.0.0/8 for 10.1.2.3/8: one rule.
	update(t, ops, rule("10.0.0.5/32", "10.0.0.0/8"), rule("10.0.0.5/32", "10.1.2.3/8"))
	wantStats(t, ops, iprules.Stats{Rules: 1, Adds: 1})
	prune(t, ops, rule("10.0.0.5/32", "10.1.2.3/8"))
	wantStats(t, ops, iprules.Stats{Rules: 1, Adds: 1})
}

func TestOpsPruneNeverTouchesForeignRules(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	keep := rule("10.0.0.5/32", "10.0.0.0/8")
	stale := rule("10.0.0.5/32", "172.16.0.0/12")
	fresh := rule("10.0.0.5/32", "192.168.0.0/16")
	// Rules another tool made, one with exactly the selectors of a stale
	// owned rule and one that no object wants at all.
	m.AddForeign(stale.Key(), unix.RTPROT_STATIC)
	m.AddForeign(key("10.0.0.6/32", "10.0.0.0/8"), unix.RTPROT_BOOT)
	// Rules a previous agent left.
	for _, r := range []*tables.IPRule{keep, stale} {
		if err := m.Add(r.Key()); err != nil {
			t.Fatal(err)
		}
	}

	ops := iprules.NewOps(m)
	prune(t, ops, keep, fresh)
	wantStats(t, ops, iprules.Stats{Rules: 2, Adds: 1, Deletes: 1})
	wantDump(t, m,
		"111: from 10.0.0.5/32 to 10.0.0.0/8 lookup 11 proto 170",
		"111: from 10.0.0.5/32 to 172.16.0.0/12 lookup 11 proto 4",
		"111: from 10.0.0.5/32 to 192.168.0.0/16 lookup 11 proto 170",
		"111: from 10.0.0.6/32 to 10.0.0.0/8 lookup 11 proto 3",
	)

	// An empty desired set removes every owned rule and nothing else.
	prune(t, ops)
	wantStats(t, ops, iprules.Stats{Rules: 0, Adds: 1, Deletes: 3})
	wantDump(t, m,
		"111: from 10.0.0.5/32 to 172.16.0.0/12 lookup 11 proto 4",
		"111: from 10.0.0.6/32 to 10.0.0.0/8 lookup 11 proto 3",
	)
}

func TestOpsPruneRepairsDrift(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	ops := iprules.NewOps(m)
	a := rule("10.0.0.5/32", "10.0.0.0/8")
	b := rule("10.0.0.5/32", "192.168.0.0/16")
	update(t, ops, a, b)

	// 1. Someone deletes an owned rule and adds one with the owned protocol.
	if err := m.Del(a.Key()); err != nil {
		t.Fatal(err)
	}
	if err := m.Add(key("10.0.0.7/32", "10.0.0.0/8")); err != nil {
		t.Fatal(err)
	}

	// 2. Update trusts the cache: no write until the next full round.
	update(t, ops, a, b)
	wantStats(t, ops, iprules.Stats{Rules: 2, Adds: 2})

	// 3. Prune re-reads the kernel: exactly the drift is repaired.
	prune(t, ops, a, b)
	wantStats(t, ops, iprules.Stats{Rules: 2, Adds: 3, Deletes: 1})
	wantDump(t, m,
		"111: from 10.0.0.5/32 to 10.0.0.0/8 lookup 11 proto 170",
		"111: from 10.0.0.5/32 to 192.168.0.0/16 lookup 11 proto 170",
	)
}

func TestOpsConfigChangeWritesTheDelta(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	endpoints := []string{"10.0.0.5/32", "10.0.0.6/32", "10.0.0.7/32"}
	before := product(endpoints, []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"})
	after := product(endpoints, []string{"10.0.0.0/8", "192.168.0.0/16", "100.64.0.0/10"})

	ops := iprules.NewOps(m)
	prune(t, ops, before...)
	update(t, ops, before...)
	wantStats(t, ops, iprules.Stats{Rules: 9, Adds: 9})

	// One CIDR replaced: one add and one delete per endpoint.
	prune(t, ops, after...)
	update(t, ops, after...)
	wantStats(t, ops, iprules.Stats{Rules: 9, Adds: 12, Deletes: 3})
	if got := strings.Count(m.Dump(), "172.16.0.0/12"); got != 0 {
		t.Fatalf("stale CIDR still has %d rules:\n%s", got, m.Dump())
	}
}

func TestOpsRestartMakesNoWrites(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	rules := product(
		[]string{"10.0.0.5/32", "10.0.0.6/32", "fd00::5/128"},
		[]string{"10.0.0.0/8", "192.168.0.0/16", "fd00::/8"},
	)
	// Mixed-family pairs are not rules; keep the valid ones.
	var valid []*tables.IPRule
	for _, r := range rules {
		if r.From.Addr().Is4() == r.To.Addr().Is4() {
			valid = append(valid, r)
		}
	}
	first := iprules.NewOps(m)
	update(t, first, valid...)
	wantStats(t, first, iprules.Stats{Rules: len(valid), Adds: uint64(len(valid))})

	// The agent restarts over a kernel that is already right: the full
	// reconciliation (Prune, then Update of every row) writes nothing.
	again := iprules.NewOps(m)
	prune(t, again, valid...)
	update(t, again, valid...)
	wantStats(t, again, iprules.Stats{Rules: len(valid)})

	// Incremental updates before the first prune also load the cache first.
	third := iprules.NewOps(m)
	update(t, third, valid...)
	wantStats(t, third, iprules.Stats{Rules: len(valid)})
}

func TestOpsFaults(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	boom := errors.New("injected fault")
	ctx := context.Background()
	a := rule("10.0.0.5/32", "10.0.0.0/8")
	b := rule("10.0.0.5/32", "192.168.0.0/16")

	// 1. The cache cannot be loaded: Update fails and writes nothing.
	m.SetFaulty(boom)
	ops := iprules.NewOps(m)
	err := ops.Update(ctx, nil, 0, a)
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "list ip rules") {
		t.Fatalf("update with faulty list = %v, want a list error wrapping %v", err, boom)
	}

	// 2. Healthy again: the retry succeeds.
	m.SetFaulty(nil)
	update(t, ops, a)
	wantStats(t, ops, iprules.Stats{Rules: 1, Adds: 1})

	// 3. Failed writes name the operation and the rule, and are not counted.
	m.SetFaulty(boom)
	err = ops.Update(ctx, nil, 0, b)
	const wantAdd = `add ip rule "111: from 10.0.0.5/32 to 192.168.0.0/16 lookup 11": injected fault`
	if !errors.Is(err, boom) || err.Error() != wantAdd {
		t.Fatalf("update = %v, want %s", err, wantAdd)
	}
	err = ops.Delete(ctx, nil, 0, a)
	const wantDel = `delete ip rule "111: from 10.0.0.5/32 to 10.0.0.0/8 lookup 11": injected fault`
	if !errors.Is(err, boom) || err.Error() != wantDel {
		t.Fatalf("delete = %v, want %s", err, wantDel)
	}
	if err := ops.Prune(ctx, nil, desired(b)); !errors.Is(err, boom) {
		t.Fatalf("prune = %v, want %v", err, boom)
	}
	wantStats(t, ops, iprules.Stats{Rules: 1, Adds: 1})

	// 4. Healthy again: the reconciler's retries converge.
	m.SetFaulty(nil)
	update(t, ops, b)
	del(t, ops, a)
	wantStats(t, ops, iprules.Stats{Rules: 1, Adds: 2, Deletes: 1})
	prune(t, ops, b)
	wantStats(t, ops, iprules.Stats{Rules: 1, Adds: 2, Deletes: 1})
	wantDump(t, m, "111: from 10.0.0.5/32 to 192.168.0.0/16 lookup 11 proto 170")
}

func TestOpsPruneReportsEveryFailure(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	ops := iprules.NewOps(m)
	good := rule("10.0.0.5/32", "10.0.0.0/8")
	mixed := rule("10.0.0.5/32", "fd00::/8")
	err := ops.Prune(context.Background(), nil, desired(mixed, good))
	if err == nil || !strings.Contains(err.Error(), `add ip rule "111: from 10.0.0.5/32 to fd00::/8 lookup 11"`) {
		t.Fatalf("prune = %v, want the mixed-family rule named", err)
	}
	// The valid rule was still written.
	wantStats(t, ops, iprules.Stats{Rules: 1, Adds: 1})
}

func TestOpsPruneStopsWhenCancelled(t *testing.T) {
	ops := iprules.NewOps(iprulestest.NewMemoryTarget())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := ops.Prune(ctx, nil, desired(rule("10.0.0.5/32", "10.0.0.0/8")))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("prune = %v, want %v", err, context.Canceled)
	}
	wantStats(t, ops, iprules.Stats{})
}

func TestOpsStatsConcurrent(t *testing.T) {
	ops := iprules.NewOps(iprulestest.NewMemoryTarget())
	var wg sync.WaitGroup
	done := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-done:
				return
			default:
				_ = ops.Stats()
			}
		}
	})
	update(t, ops, product([]string{"10.0.0.5/32", "10.0.0.6/32"}, []string{"10.0.0.0/8", "192.168.0.0/16"})...)
	close(done)
	wg.Wait()
	wantStats(t, ops, iprules.Stats{Rules: 4, Adds: 4})
}

func TestMemoryTargetDump(t *testing.T) {
	m := iprulestest.NewMemoryTarget()
	m.AddForeign(tables.IPRuleKey{
		Priority: 0, From: netip.MustParsePrefix("0.0.0.0/0"), To: netip.MustParsePrefix("0.0.0.0/0"), Table: 255,
	}, unix.RTPROT_KERNEL)
	for _, k := range []tables.IPRuleKey{
		key("10.0.0.5/32", "192.168.0.0/16"),
		key("10.0.0.5/32", "10.0.0.0/8"),
		key("10.0.0.10/32", "10.0.0.0/8"),
		{Priority: 100, From: netip.MustParsePrefix("10.0.0.9/32"), To: netip.MustParsePrefix("10.0.0.0/8"), Table: 12},
	} {
		if err := m.Add(k); err != nil {
			t.Fatal(err)
		}
	}
	wantDump(t, m,
		"0: from 0.0.0.0/0 to 0.0.0.0/0 lookup 255 proto 2",
		"100: from 10.0.0.9/32 to 10.0.0.0/8 lookup 12 proto 170",
		"111: from 10.0.0.5/32 to 10.0.0.0/8 lookup 11 proto 170",
		"111: from 10.0.0.5/32 to 192.168.0.0/16 lookup 11 proto 170",
		"111: from 10.0.0.10/32 to 10.0.0.0/8 lookup 11 proto 170",
	)
	keys, err := m.List()
	if err != nil || len(keys) != 4 {
		t.Fatalf("list = %v, %v; want the 4 owned rules", keys, err)
	}
}
