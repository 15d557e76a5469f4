package tcattach

import (
	"log/slog"
	"path/filepath"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Name is the reconciler's name: its health scope, metrics label and
// fault point.
const Name = "tc-attach"

// Cell attaches the loaded datapath's programs to the devices of table
// datapath-devices (cells/datapathtables) and writes their SNAT addresses
// into egress_devs. It needs datapath.Cell.
var Cell = cell.Group(
	// The Operations, in the hive so that tests decorate them (fault
	// injection, the test's network namespace).
	cell.Provide(newOps),
	cell.Invoke(register),
)

type opsParams struct {
	cell.In

	DB        *statedb.DB
	Agent     settings.Config
	Config    datapath.Config
	Handle    *datapath.Handle
	Sources   statedb.Table[*tables.MasqueradeSource]
	NodeAddrs statedb.Table[*tables.NodeAddress]
}

// newOps are the operations of the tc-attach reconciler.
func newOps(p opsParams) reconciler.Operations[*tables.DatapathDevice] {
	return &attachOps{linkDir: filepath.Join(p.Agent.PinDir(), "links"), dp: p.Handle, mode: p.Config.TCAttachMode,
		waitMaps: waitMapsWritten(p.DB, p.Sources, p.NodeAddrs)}
}

type params struct {
	cell.In

	Log            *slog.Logger
	DB             *statedb.DB
	Jobs           job.Registry
	Health         cell.Health
	ModuleID       cell.FullModuleID
	DefaultMetrics reconciler.Metrics `optional:"true"`
	Table          statedb.RWTable[*tables.DatapathDevice]
	Ops            reconciler.Operations[*tables.DatapathDevice]
}

func register(p params) error {
	return datapath.Register(
		reconciler.Params{Log: p.Log, DB: p.DB, JobGroup: p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log)),
			ModuleID: p.ModuleID, DefaultMetrics: p.DefaultMetrics},
		Name, p.Table,
		(*tables.DatapathDevice).Clone, (*tables.DatapathDevice).SetStatus, (*tables.DatapathDevice).GetStatus,
		p.Ops)
}
