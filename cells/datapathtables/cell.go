// Package datapathtables derives the tables the eBPF datapath is
// reconciled from; it writes tables only, and a reconciler per table
// (reconcilers/tcattach, masqrules, nodeaddrs, masqsources) writes them
// into the kernel:
//
//	egress-devices + masquerade-rules ──▶ datapath-devices, masquerade-rule-sources
//	egress-devices (every address)    ──▶ node-addresses
//	node-addresses + masquerade-rule-sources
//	  (+ pod-cidrs with --masquerade-pod-cidrs-only) ──▶ masquerade-sources
package datapathtables

import (
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell provides the datapath's tables and the jobs that derive them.
var Cell = cell.Module(
	"datapath-tables",
	"Datapath tables from devices and masquerade rules and pod CIDRs",

	cell.Config(DefaultConfig),
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
	Sources     Config
	Devices     statedb.Table[*tables.EgressDevice]
	Rules       statedb.Table[*tables.MasqueradeRule]
	PodCIDRs    statedb.Table[*tables.PodCIDR]
	DPDevices   statedb.RWTable[*tables.DatapathDevice]
	RuleSources statedb.RWTable[*tables.MasqueradeRuleSource]
	SourceRows  statedb.RWTable[*tables.MasqueradeSource]
	NodeAddrs   statedb.RWTable[*tables.NodeAddress]
}

func register(p params) {
	wtxn := p.DB.WriteTxn(p.DPDevices, p.RuleSources, p.SourceRows, p.NodeAddrs)
	markDevices := p.DPDevices.RegisterInitializer(wtxn, "datapath")
	markRuleSources := p.RuleSources.RegisterInitializer(wtxn, "datapath")
	markNodeAddrs := p.NodeAddrs.RegisterInitializer(wtxn, "datapath")
	markSources := p.SourceRows.RegisterInitializer(wtxn, "datapath")
	wtxn.Commit()

	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	d := &deriver{params: p, markInitialized: func(wtxn statedb.WriteTxn) {
		markDevices(wtxn)
		markRuleSources(wtxn)
		markNodeAddrs(wtxn)
	}}
	g.Add(job.OneShot("derive-devices", d.run))
	s := &sourcesDeriver{params: p, markInitialized: markSources}
	g.Add(job.OneShot("derive-sources", s.run))
}
