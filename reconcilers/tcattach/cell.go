package tcattach

import (
	"log/slog"
	"path/filepath"

	"github.com/cilium/hive/cell"
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

	DB     *statedb.DB
	Agent  settings.Config
	Config datapath.Config
	Handle *datapath.Handle
	Log    *slog.Logger
	Tables mapsWrittenTables
}

// newOps are the operations of the tc-attach reconciler.
func newOps(p opsParams) reconciler.Operations[*tables.DatapathDevice] {
	return &attachOps{linkDir: filepath.Join(p.Agent.PinDir(), "links"), dp: p.Handle, mode: p.Config.TCAttachMode,
		waitMaps: waitMapsWritten(p.DB, p.Log, p.Tables), log: p.Log}
}

func register(p datapath.ReconcilerParams, tbl statedb.RWTable[*tables.DatapathDevice],
	ops reconciler.Operations[*tables.DatapathDevice]) error {
	return datapath.Register(p, Name, tbl, (*tables.DatapathDevice).Clone, (*tables.DatapathDevice).SetStatus,
		(*tables.DatapathDevice).GetStatus, ops)
}
