// Package netfilter is the cell that finds netfilter NAT rules deciding
// before ipmasq: netfilter's POSTROUTING runs before the tc egress programs,
// so a MASQUERADE left by the Kubernetes ip-masq-agent (its IP-MASQ-AGENT
// chain) or any MASQUERADE/SNAT rule matching pod sources translates the
// packet first, and the config never decides. It reads them over nftables'
// netlink API (iptables-nft rules are nftables rules; iptables-legacy tables
// are only seen to exist) into the netfilter-nat-rules table, which the
// status, the metrics and one warning line report. It never edits
// netfilter: removing the rules is the operator's call (docs/migrate.md).
package netfilter

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/tables"
)

// ScanInterval is how often netfilter is read again (and whenever the pod
// CIDRs change, and a second after nftables' rules change: Changes): the rules it looks for are left-overs and manual rules,
// not a hot path, and one dump of the rules costs well under a millisecond.
const ScanInterval = 30 * time.Second

// Scanner reads the NAT rules that decide before ipmasq for the given
// masquerade sources. The agent's is Scan in its own namespace; tests run
// it in theirs (testkit/netnstest).
type Scanner func(sources []netip.Prefix) ([]*tables.NetfilterNATRule, error)

// Cell provides table netfilter-nat-rules and keeps it in step with the
// namespace's netfilter rules. It needs statedb.Cell, job.Cell, a
// cell.Health and table pod-cidrs.
var Cell = cell.Module(
	"netfilter",
	"Netfilter NAT rules that decide before ipmasq - read-only",

	cell.ProvidePrivate(tables.NewNetfilterNATRuleTable),
	cell.Provide(
		func(t statedb.RWTable[*tables.NetfilterNATRule]) statedb.Table[*tables.NetfilterNATRule] { return t },
		func() Scanner {
			return func(sources []netip.Prefix) ([]*tables.NetfilterNATRule, error) {
				return Scan("/proc/thread-self/net", sources)
			}
		},
		func() Changes { return WatchNftables },
	),
	cell.Invoke(register),
)

type params struct {
	cell.In

	Log      *slog.Logger
	DB       *statedb.DB
	Jobs     job.Registry
	Health   cell.Health
	Rules    statedb.RWTable[*tables.NetfilterNATRule]
	PodCIDRs statedb.Table[*tables.PodCIDR]
	Scan     Scanner
	Changes  Changes
}

func register(p params) {
	w := &watcher{params: p}
	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	g.Add(job.OneShot("scan-netfilter", w.run))
}

type watcher struct {
	params
	// reported is what the last warning (or all-clear) said, so that one
	// set of rules is reported once, not at every scan.
	reported string
}

func (w *watcher) run(ctx context.Context, health cell.Health) error {
	var changes <-chan struct{}
	if w.Changes != nil {
		var err error
		if changes, err = w.Changes(ctx); err != nil {
			w.Log.Warn("Cannot watch netfilter's rules for changes: they are read at the scan interval only", "interval", ScanInterval, "error", err)
		}
	}
	for {
		txn := w.DB.ReadTxn()
		sources := tables.PodCIDRPrefixes(txn, w.PodCIDRs)
		_, podCIDRsChanged := w.PodCIDRs.AllWatch(txn)
		rows, err := w.Scan(sources)
		if err != nil {
			health.Degraded("cannot read netfilter's NAT rules", err)
		} else {
			w.write(rows)
			health.OK(fmt.Sprintf("%d netfilter NAT rules decide before ipmasq", len(rows)))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(ScanInterval):
		case <-podCIDRsChanged:
		case _, ok := <-changes:
			if !ok {
				return nil // the watch ends with ctx
			}
			// Let the burst of changes settle (an iptables-restore
			// writes many); what comes meanwhile is in this scan.
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(changeSettle):
			}
			select {
			case <-changes:
			default:
			}
		}
	}
}

// write makes the table exactly rows and logs one line when what it holds
// changed: a warning naming every rule, or that none is left.
func (w *watcher) write(rows []*tables.NetfilterNATRule) {
	wtxn := w.DB.WriteTxn(w.Rules)
	want := map[string]bool{}
	for _, r := range rows {
		want[r.Key()] = true
		if old, _, ok := w.Rules.Get(wtxn, tables.NetfilterNATRuleByKey.Query(r.Key())); !ok || *old != *r {
			w.Rules.Insert(wtxn, r)
		}
	}
	for old := range w.Rules.All(wtxn) {
		if !want[old.Key()] {
			w.Rules.Delete(wtxn, old)
		}
	}
	wtxn.Commit()

	summary := tables.DescribeNetfilterNATRules(rows)
	if summary == w.reported {
		return
	}
	w.reported = summary
	if len(rows) == 0 {
		w.Log.Info("No netfilter NAT rule decides before ipmasq any more")
		return
	}
	w.Log.Warn("Netfilter NAT rules decide before ipmasq: traffic they translate never reaches its decision; remove them once every node is ready (docs/migrate.md). ipmasq does not edit netfilter",
		"rules", summary)
}
