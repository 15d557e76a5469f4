package datapath

import (
	"context"
	"errors"
	"iter"
	"time"

	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/internal/faults"
	"github.com/ipmasq/ipmasq/tables"
)

// masqRuleOps writes masquerade-rule-sources into masq_rules_v4/v6, each row to
// the map of its family. The maps come with the datapath, so the operations
// are set up at their first use.
type masqRuleOps struct {
	dp *Handle
	v4 *bpfmap.Ops[*tables.MasqueradeRuleSource, bpf.MasqRuleKeyV4, bpf.MasqRule]
	v6 *bpfmap.Ops[*tables.MasqueradeRuleSource, bpf.MasqRuleKeyV6, bpf.MasqRule]
}

var _ reconciler.Operations[*tables.MasqueradeRuleSource] = (*masqRuleOps)(nil)

func (o *masqRuleOps) ready() error {
	if o.v4 != nil {
		return nil
	}
	dp := o.dp.get()
	if dp == nil {
		return ErrNotLoaded
	}
	m4, err := bpfmap.NewMap[bpf.MasqRuleKeyV4, bpf.MasqRule](dp.Maps.MasqRulesV4)
	if err != nil {
		return err
	}
	m6, err := bpfmap.NewMap[bpf.MasqRuleKeyV6, bpf.MasqRule](dp.Maps.MasqRulesV6)
	if err != nil {
		return err
	}
	o.v4 = bpfmap.NewOps(m4, func(s *tables.MasqueradeRuleSource) (bpf.MasqRuleKeyV4, bpf.MasqRule) {
		return bpf.MasqRuleKeyV4From(s.Ifindex, s.Source), bpf.MasqRuleTo(s.ToAddress)
	})
	o.v6 = bpfmap.NewOps(m6, func(s *tables.MasqueradeRuleSource) (bpf.MasqRuleKeyV6, bpf.MasqRule) {
		return bpf.MasqRuleKeyV6From(s.Ifindex, s.Source), bpf.MasqRuleTo(s.ToAddress)
	})
	return nil
}

func is4(s *tables.MasqueradeRuleSource) bool { return s.Source.Addr().Is4() }

// Update implements reconciler.Operations.
func (o *masqRuleOps) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, s *tables.MasqueradeRuleSource) error {
	if err := o.ready(); err != nil {
		return err
	}
	if is4(s) {
		return o.v4.Update(ctx, txn, rev, s)
	}
	return o.v6.Update(ctx, txn, rev, s)
}

// Delete implements reconciler.Operations.
func (o *masqRuleOps) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, s *tables.MasqueradeRuleSource) error {
	if err := o.ready(); err != nil {
		return err
	}
	if is4(s) {
		return o.v4.Delete(ctx, txn, rev, s)
	}
	return o.v6.Delete(ctx, txn, rev, s)
}

// Prune implements reconciler.Operations.
func (o *masqRuleOps) Prune(ctx context.Context, txn statedb.ReadTxn, objs iter.Seq2[*tables.MasqueradeRuleSource, statedb.Revision]) error {
	if err := o.ready(); err != nil {
		return err
	}
	only := func(v4 bool) iter.Seq2[*tables.MasqueradeRuleSource, statedb.Revision] {
		return func(yield func(*tables.MasqueradeRuleSource, statedb.Revision) bool) {
			for s, rev := range objs {
				if is4(s) == v4 && !yield(s, rev) {
					return
				}
			}
		}
	}
	return errors.Join(o.v4.Prune(ctx, txn, only(true)), o.v6.Prune(ctx, txn, only(false)))
}

// registerMasqueradeRuleSources registers the reconciler of masquerade-rule-sources.
func registerMasqueradeRuleSources(p params, g job.Group) error {
	_, err := reconciler.Register(
		reconciler.Params{Log: p.Log, DB: p.DB, JobGroup: g, ModuleID: p.ModuleID, DefaultMetrics: p.Metrics},
		p.RuleSources,
		(*tables.MasqueradeRuleSource).Clone,
		(*tables.MasqueradeRuleSource).SetStatus,
		(*tables.MasqueradeRuleSource).GetStatus,
		faults.Wrap[*tables.MasqueradeRuleSource](p.Faults, faults.MasqRules, &masqRuleOps{dp: p.Handle}),
		nil,
		reconciler.WithName("masq-rules"),
		reconciler.WithPruning(time.Hour),
		reconciler.WithRefreshing(0, nil),
		reconciler.WithRoundLimits(1000, rate.NewLimiter(rate.Inf, 1)),
	)
	return err
}
