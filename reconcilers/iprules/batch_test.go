package iprules_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
)

// batchTarget is the kernel target with pipelined writes into ns.
func batchTarget(t *testing.T, ns *testNetns) iprules.NetlinkTarget {
	t.Helper()
	target, err := iprules.NewNetlinkTargetAt(ns.ns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { target.Close() })
	return target
}

// manyRules returns n IPv4 rules of distinct endpoints, more than one
// pipelined datagram holds when n > 256.
func manyRules(n int) []*tables.IPRule {
	rules := make([]*tables.IPRule, n)
	for i := range rules {
		rules[i] = rule(fmt.Sprintf("10.96.%d.%d/32", i/250, i%250+1), "10.0.0.0/8")
	}
	return rules
}

func entries(rules ...*tables.IPRule) []reconciler.BatchEntry[*tables.IPRule] {
	b := make([]reconciler.BatchEntry[*tables.IPRule], len(rules))
	for i, r := range rules {
		b[i].Object = r
	}
	return b
}

func noErrors(t *testing.T, what string, errs []error) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("%s [%d]: %v", what, i, err)
		}
	}
}

// The pipelined writes install and remove exactly what one request at a
// time does, wildcards and large tables included, across datagrams.
func TestNetlinkBatchAddDel(t *testing.T) {
	ns := newNetns(t, false)
	target := batchTarget(t, ns)
	base := countRules(t, ns.Handle)
	special := []tables.IPRuleKey{
		key("fd00::5/128", "fd00::/8"),
		key("::/0", "fd00::/8"),
		key("2001:db8::1/128", "::/0"),
		key("0.0.0.0/0", "10.0.0.0/8"),
		key("10.0.0.5/32", "0.0.0.0/0"),
		key("10.0.0.5/32", "10.0.0.0/8"),
		{Priority: 40000, From: netip.MustParsePrefix("10.0.0.5/32"), To: netip.MustParsePrefix("10.0.0.0/8"), Table: 1000},
	}
	want := append(keysOf(manyRules(600)), special...)

	noErrors(t, "add", target.AddBatch(want))
	wantList(t, target, want...)
	// Rules already there (the wildcards too) are success, not duplicates.
	noErrors(t, "add again", target.AddBatch(want))
	if got := countRules(t, ns.Handle); got != base+len(want) {
		t.Fatalf("%d rules, want %d", got, base+len(want))
	}

	// Delete the first 300 and the wildcards, plus rules that are absent.
	gone := append(want[:300:300], special[1:5]...)
	absent := key("10.200.0.1/32", "10.0.0.0/8")
	noErrors(t, "delete", target.DelBatch(append(gone, absent)))
	keep := append(want[300:600:600], special[0], special[5], special[6])
	wantList(t, target, keep...)
	noErrors(t, "delete again", target.DelBatch(gone))
	wantList(t, target, keep...)
}

// One rule that cannot be written fails alone: the others of the batch are
// written and only its entry has an error, naming the rule (the reconciler
// retries exactly the entries with an error).
func TestOpsBatchReportsOnlyTheFailedRule(t *testing.T) {
	ns := newNetns(t, false)
	target := batchTarget(t, ns)
	ops := iprules.NewOps(target)
	rules := manyRules(500)
	bad := rule("10.0.0.5/32", "fd00::/8") // mixed families: not one rule
	batch := entries(append(rules[:300:300], append([]*tables.IPRule{bad}, rules[300:]...)...)...)

	ops.UpdateBatch(context.Background(), nil, batch)
	for i, e := range batch {
		switch {
		case i == 300 && (e.Result == nil || !strings.Contains(e.Result.Error(), `add ip rule "111: from 10.0.0.5/32 to fd00::/8 lookup 11"`)):
			t.Fatalf("bad rule's result = %v, want it named", e.Result)
		case i != 300 && e.Result != nil:
			t.Fatalf("result [%d] = %v, want nil", i, e.Result)
		}
	}
	wantStats(t, ops, iprules.Stats{Rules: 500, Adds: 500})
	wantList(t, target, keysOf(rules)...)

	// A restart over the right kernel makes no writes.
	again := iprules.NewOps(target)
	again.UpdateBatch(context.Background(), nil, entries(rules...))
	wantStats(t, again, iprules.Stats{Rules: 500})

	// Deleting writes only what is there.
	again.DeleteBatch(context.Background(), nil, entries(append(rules[:100:100], rule("10.200.0.1/32", "10.0.0.0/8"))...))
	wantStats(t, again, iprules.Stats{Rules: 400, Deletes: 100})
	wantList(t, target, keysOf(rules[100:])...)
}
