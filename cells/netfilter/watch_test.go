package netfilter

import (
	"context"
	"log/slog"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/tables"
)

// TestChangeScansAgain: a change told by Changes makes the watcher read
// netfilter again about changeSettle later, not at the next ScanInterval
// (the Kubernetes agent's chain put back during a migration is seen at
// once).
func TestChangeScansAgain(t *testing.T) {
	db := statedb.New()
	rules, err := tables.NewNetfilterNATRuleTable(db)
	if err != nil {
		t.Fatal(err)
	}
	podCIDRs, err := tables.NewPodCIDRTable(db)
	if err != nil {
		t.Fatal(err)
	}
	var scans atomic.Int32
	changes := make(chan struct{}, 1)
	w := &watcher{params: params{
		Log: slog.New(slog.DiscardHandler), DB: db, Rules: rules, PodCIDRs: podCIDRs,
		Scan: func([]netip.Prefix) ([]*tables.NetfilterNATRule, error) {
			scans.Add(1)
			return nil, nil
		},
		Changes: func(context.Context) (<-chan struct{}, error) { return changes, nil },
	}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.run(ctx, nopHealth{})
	}()
	defer func() { cancel(); <-done }()

	waitScans := func(n int32, within time.Duration) {
		t.Helper()
		for deadline := time.Now().Add(within); scans.Load() < n; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d scan(s) after %v, want %d", scans.Load(), within, n)
			}
		}
	}
	waitScans(1, 5*time.Second)
	for i := range 3 {
		changes <- struct{}{}
		waitScans(int32(2+i), changeSettle+5*time.Second)
	}
	if n := scans.Load(); n != 4 {
		t.Errorf("%d scans for the start and three changes, want 4", n)
	}
}

// nopHealth is a cell.Health that reports nowhere.
type nopHealth struct{}

func (nopHealth) OK(string)                   {}
func (nopHealth) Stopped(string)              {}
func (nopHealth) Degraded(string, error)      {}
func (nopHealth) NewScope(string) cell.Health { return nopHealth{} }
func (nopHealth) Close()                      {}

// TestWatchNftablesSeesRuleChanges: the watch tells of the Kubernetes
// agent's chain created and deleted (iptables-nft) in its namespace, and
// of nothing done in another.
func TestWatchNftablesSeesRuleChanges(t *testing.T) {
	ns, other := newNetns(t), newNetns(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var changes <-chan struct{}
	if err := ns.Do(func() (err error) {
		changes, err = WatchNftables(ctx)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	quiet := func(what string) {
		t.Helper()
		select {
		case <-changes:
			t.Fatalf("a change told after %s", what)
		case <-time.After(500 * time.Millisecond):
		}
	}
	quiet("nothing")
	if err := other.Iptables(false, "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE"); err != nil {
		t.Fatal(err)
	}
	quiet("a rule in another namespace")
	for _, rule := range [][]string{
		{"-t", "nat", "-N", IPMasqAgentChain},
		{"-t", "nat", "-A", IPMasqAgentChain, "-j", "MASQUERADE"},
		{"-t", "nat", "-F", IPMasqAgentChain},
		{"-t", "nat", "-X", IPMasqAgentChain},
	} {
		if err := ns.Iptables(false, rule...); err != nil {
			t.Fatal(err)
		}
		select {
		case <-changes:
		case <-time.After(5 * time.Second):
			t.Fatalf("no change told after iptables %v", rule)
		}
		// iptables-nft makes several changes at once: let them pass.
		time.Sleep(200 * time.Millisecond)
		select {
		case <-changes:
		default:
		}
	}
	// The watch ends with its context (its notification socket closed).
	cancel()
	for deadline := time.After(5 * time.Second); ; {
		select {
		case _, ok := <-changes:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatal("the watch did not end with its context")
		}
	}
}
