package datapath

import (
	"context"
	"iter"
	"sync"
	"time"

	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/tables"
)

// lazyOps builds its operations at first use: the maps exist only once the
// start hook has loaded the collection.
type lazyOps[Obj any] struct {
	dp    *Handle
	build func(*bpf.Datapath) (reconciler.Operations[Obj], error)

	mu  sync.Mutex
	ops reconciler.Operations[Obj]
}

func (l *lazyOps[Obj]) get() (reconciler.Operations[Obj], error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ops != nil {
		return l.ops, nil
	}
	dp := l.dp.get()
	if dp == nil {
		return nil, ErrNotLoaded
	}
	ops, err := l.build(dp)
	if err != nil {
		return nil, err
	}
	l.ops = ops
	return ops, nil
}

// Update implements reconciler.Operations.
func (l *lazyOps[Obj]) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Update(ctx, txn, rev, obj)
}

// Delete implements reconciler.Operations.
func (l *lazyOps[Obj]) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Delete(ctx, txn, rev, obj)
}

// Prune implements reconciler.Operations.
func (l *lazyOps[Obj]) Prune(ctx context.Context, txn statedb.ReadTxn, objs iter.Seq2[Obj, statedb.Revision]) error {
	ops, err := l.get()
	if err != nil {
		return err
	}
	return ops.Prune(ctx, txn, objs)
}

// masqSourceOps writes masquerade-sources into masq_src_v4/v6.
func masqSourceOps(dp *bpf.Datapath) (reconciler.Operations[*tables.MasqueradeSource], error) {
	m4, err := bpfmap.NewMap[bpf.LPMKeyV4, uint8](dp.Maps.MasqSrcV4)
	if err != nil {
		return nil, err
	}
	m6, err := bpfmap.NewMap[bpf.LPMKeyV6, uint8](dp.Maps.MasqSrcV6)
	if err != nil {
		return nil, err
	}
	return &bpfmap.ByFamily[*tables.MasqueradeSource]{
		V4: bpfmap.NewOps(m4, func(s *tables.MasqueradeSource) (bpf.LPMKeyV4, uint8) {
			return bpf.LPMKeyV4From(s.Prefix), 1
		}),
		V6: bpfmap.NewOps(m6, func(s *tables.MasqueradeSource) (bpf.LPMKeyV6, uint8) {
			return bpf.LPMKeyV6From(s.Prefix), 1
		}),
		Is4:   func(s *tables.MasqueradeSource) bool { return s.Prefix.Addr().Is4() },
		Name:  func(s *tables.MasqueradeSource) string { return s.Prefix.String() },
		MapV4: bpf.MapMasqSrcV4, MapV6: bpf.MapMasqSrcV6,
	}, nil
}

// nodeAddressOps writes node-addresses into node_addrs_v4/v6.
func nodeAddressOps(dp *bpf.Datapath) (reconciler.Operations[*tables.NodeAddress], error) {
	m4, err := bpfmap.NewMap[uint32, uint8](dp.Maps.NodeAddrsV4)
	if err != nil {
		return nil, err
	}
	m6, err := bpfmap.NewMap[[16]byte, uint8](dp.Maps.NodeAddrsV6)
	if err != nil {
		return nil, err
	}
	return &bpfmap.ByFamily[*tables.NodeAddress]{
		V4:   bpfmap.NewOps(m4, func(a *tables.NodeAddress) (uint32, uint8) { return bpf.Addr4(a.Addr), 1 }),
		V6:   bpfmap.NewOps(m6, func(a *tables.NodeAddress) ([16]byte, uint8) { return a.Addr.As16(), 1 }),
		Is4:  func(a *tables.NodeAddress) bool { return a.Addr.Is4() },
		Name: func(a *tables.NodeAddress) string { return a.Addr.String() },
	}, nil
}

// registerMapReconcilers registers the reconcilers of the tables written
// into the programs' maps: masquerade-rule-sources, masquerade-sources and
// node-addresses.
func registerMapReconcilers(p params, g job.Group) error {
	rp := reconciler.Params{Log: p.Log, DB: p.DB, JobGroup: g, ModuleID: p.ModuleID, DefaultMetrics: p.Metrics}
	opts := func(name string) []reconciler.Option {
		return []reconciler.Option{
			reconciler.WithName(name),
			reconciler.WithPruning(time.Hour),
			reconciler.WithRefreshing(0, nil),
			reconciler.WithRoundLimits(1000, rate.NewLimiter(rate.Inf, 1)),
		}
	}
	if _, err := reconciler.Register(rp, p.RuleSources,
		(*tables.MasqueradeRuleSource).Clone, (*tables.MasqueradeRuleSource).SetStatus, (*tables.MasqueradeRuleSource).GetStatus,
		p.MasqRuleOps,
		nil, opts("masq-rules")...); err != nil {
		return err
	}
	if _, err := reconciler.Register(rp, p.Sources,
		(*tables.MasqueradeSource).Clone, (*tables.MasqueradeSource).SetStatus, (*tables.MasqueradeSource).GetStatus,
		&lazyOps[*tables.MasqueradeSource]{dp: p.Handle, build: masqSourceOps},
		nil, opts("masq-sources")...); err != nil {
		return err
	}
	_, err := reconciler.Register(rp, p.NodeAddrs,
		(*tables.NodeAddress).Clone, (*tables.NodeAddress).SetStatus, (*tables.NodeAddress).GetStatus,
		&lazyOps[*tables.NodeAddress]{dp: p.Handle, build: nodeAddressOps},
		nil, opts("node-addresses")...)
	return err
}

// mapsWrittenWait bounds how long an attachment waits for the masquerade
// sources and node addresses to be in their maps: long enough for the
// first write at start, short enough that a failing map write (reported by
// its own reconciler) does not hold the attachments back.
const mapsWrittenWait = time.Second

// waitMapsWritten returns once masquerade-sources and node-addresses are
// initialized and every row is in its map, or after mapsWrittenWait, so
// that the first packets through a new attachment are decided with the pod
// sources and node addresses in place.
func waitMapsWritten(db *statedb.DB, sources statedb.Table[*tables.MasqueradeSource], addrs statedb.Table[*tables.NodeAddress]) func(context.Context) {
	return func(ctx context.Context) {
		deadline := time.NewTimer(mapsWrittenWait)
		defer deadline.Stop()
		for {
			txn := db.ReadTxn()
			srcRows, srcWatch := sources.AllWatch(txn)
			addrRows, addrWatch := addrs.AllWatch(txn)
			srcInit, srcInitWatch := sources.Initialized(txn)
			addrInit, addrInitWatch := addrs.Initialized(txn)
			// An initialized table's watch channel is closed.
			if srcInit {
				srcInitWatch = nil
			}
			if addrInit {
				addrInitWatch = nil
			}
			done := srcInit && addrInit
			for s := range srcRows {
				done = done && s.Status.Kind == reconciler.StatusKindDone
			}
			for a := range addrRows {
				done = done && a.Status.Kind == reconciler.StatusKindDone
			}
			if done {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-deadline.C:
				return
			case <-srcWatch:
			case <-addrWatch:
			case <-srcInitWatch:
			case <-addrInitWatch:
			}
		}
	}
}
