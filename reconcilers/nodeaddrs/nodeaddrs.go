// Package nodeaddrs writes table node-addresses into the datapath's maps
// node_addrs_v4/v6: the node's own addresses; a packet to one of them is
// never masqueraded.
//
// It is the pattern of a reconciler of one map (or one map per family) of
// the loaded datapath: copy this package for a new map. Its entries say how
// a row becomes an entry of each family's map (bpfmap.Entries), its
// Operations are bpfmap.Ops over the loaded datapath's maps
// (datapath.Handle is their bpfmap.Loader), provided in the hive (so tests
// decorate them, e.g. faults.Decorate), and registered with
// datapath.Register (datapath.ReconcilerParams) under the reconciler's
// name; the agent adds the Cell to agent.Datapath after datapath.Cell.
package nodeaddrs

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/tables"
)

// Name is the reconciler's name: its health scope, metrics label and
// fault point.
const Name = "node-addresses"

// Cell reconciles node-addresses into node_addrs_v4/v6. It needs
// datapath.Cell (the loaded datapath) and the node-addresses table
// (cells/datapathtables).
var Cell = cell.Group(
	// The Operations, in the hive so that tests decorate them.
	cell.Provide(newOps),
	cell.Invoke(register),
)

// entries writes each address into the map of its family.
var entries = bpfmap.Entries[*tables.NodeAddress, uint32, [16]byte, uint8]{
	MapV4: bpf.MapNodeAddrsV4, MapV6: bpf.MapNodeAddrsV6,
	Is4:  func(a *tables.NodeAddress) bool { return a.Addr.Is4() },
	V4:   func(a *tables.NodeAddress) (uint32, uint8) { return bpf.Addr4(a.Addr), 1 },
	V6:   func(a *tables.NodeAddress) ([16]byte, uint8) { return a.Addr.As16(), 1 },
	Name: func(a *tables.NodeAddress) string { return a.Addr.String() },
}

func newOps(h *datapath.Handle) reconciler.Operations[*tables.NodeAddress] {
	return bpfmap.NewOps(h, entries)
}

func register(p datapath.ReconcilerParams, tbl statedb.RWTable[*tables.NodeAddress],
	ops reconciler.Operations[*tables.NodeAddress]) error {
	return datapath.Register(p, Name, tbl, (*tables.NodeAddress).Clone, (*tables.NodeAddress).SetStatus,
		(*tables.NodeAddress).GetStatus, ops)
}
