// Package datapathtables derives the tables the eBPF datapath is
// reconciled from; it writes tables only, and a reconciler per table
// (reconcilers/tcattach, masqrules, nodeaddrs, masqsources) writes them
// into the kernel:
//
//	egress-devices + masquerade-rules ──▶ datapath-devices, masquerade-rule-sources
//	egress-devices (every address)    ──▶ node-addresses
//	pod-cidrs (enabled families)      ──▶ masquerade-sources
package datapathtables

import (
	"context"
	"log/slog"
	"net/netip"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell provides the datapath's tables and the jobs that derive them.
var Cell = cell.Module(
	"datapath-tables",
	"Datapath tables from devices and masquerade rules and pod CIDRs",

	cell.Provide(
		tables.NewDatapathDeviceTable,
		statedb.RWTable[*tables.DatapathDevice].ToTable,
		tables.NewMasqueradeRuleSourceTable,
		statedb.RWTable[*tables.MasqueradeRuleSource].ToTable,
		tables.NewMasqueradeSourceTable,
		statedb.RWTable[*tables.MasqueradeSource].ToTable,
		tables.NewNodeAddressTable,
		statedb.RWTable[*tables.NodeAddress].ToTable,
	),
	cell.Invoke(register),
)

type params struct {
	cell.In

	Log         *slog.Logger
	DB          *statedb.DB
	Jobs        job.Registry
	Health      cell.Health
	Agent       settings.Config
	Devices     statedb.Table[*tables.EgressDevice]
	Rules       statedb.Table[*tables.MasqueradeRule]
	PodCIDRs    statedb.Table[*tables.PodCIDR]
	DPDevices   statedb.RWTable[*tables.DatapathDevice]
	RuleSources statedb.RWTable[*tables.MasqueradeRuleSource]
	Sources     statedb.RWTable[*tables.MasqueradeSource]
	NodeAddrs   statedb.RWTable[*tables.NodeAddress]
}

func register(p params) {
	wtxn := p.DB.WriteTxn(p.DPDevices, p.RuleSources, p.Sources, p.NodeAddrs)
	markDevices := p.DPDevices.RegisterInitializer(wtxn, "datapath")
	markRuleSources := p.RuleSources.RegisterInitializer(wtxn, "datapath")
	markNodeAddrs := p.NodeAddrs.RegisterInitializer(wtxn, "datapath")
	markSources := p.Sources.RegisterInitializer(wtxn, "datapath")
	wtxn.Commit()

	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	d := &deriver{params: p, markInitialized: func(wtxn statedb.WriteTxn) {
		markDevices(wtxn)
		markRuleSources(wtxn)
		markNodeAddrs(wtxn)
	}}
	g.Add(job.OneShot("derive-devices", d.run))
	g.Add(job.OneShot("derive-sources", func(ctx context.Context, _ cell.Health) error {
		return deriveSources(ctx, p, markSources)
	}))
}

// deriveSources keeps masquerade-sources equal to the pod CIDRs of the
// enabled families, without host bits.
func deriveSources(ctx context.Context, p params, markInitialized func(statedb.WriteTxn)) error {
	for {
		txn := p.DB.ReadTxn()
		rows, changed := p.PodCIDRs.AllWatch(txn)
		init, initWatch := p.PodCIDRs.Initialized(txn)
		if init {
			// An initialized table's watch channel is closed: waiting on it
			// would spin.
			initWatch = nil
			want := map[netip.Prefix]bool{}
			for c := range rows {
				if a := c.Prefix.Addr(); (a.Is4() && p.Agent.EnableIPv4) || (a.Is6() && p.Agent.EnableIPv6) {
					want[c.Prefix.Masked()] = true
				}
			}
			wtxn := p.DB.WriteTxn(p.Sources)
			for row := range p.Sources.All(wtxn) {
				if want[row.Prefix] {
					delete(want, row.Prefix)
				} else {
					p.Sources.Delete(wtxn, row)
				}
			}
			for pfx := range want {
				p.Sources.Insert(wtxn, &tables.MasqueradeSource{Prefix: pfx, Status: reconciler.StatusPending()})
			}
			if markInitialized != nil {
				markInitialized(wtxn)
				markInitialized = nil
			}
			wtxn.Commit()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-initWatch:
		}
	}
}
