// Package nodeaddrs writes table node-addresses into the datapath's maps
// node_addrs_v4/v6: the node's own addresses; a packet to one of them is
// never masqueraded.
//
// It is the pattern of a reconciler of one map (or one map per family) of
// the loaded datapath: copy this package for a new map. Its Operations are
// datapath.MapOps over the loaded datapath's maps, provided in the hive (so
// tests decorate them, e.g. faults.Decorate), and registered with
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

func newOps(h *datapath.Handle) reconciler.Operations[*tables.NodeAddress] {
	return datapath.MapOps(h, buildOps)
}

// buildOps writes each row into the map of its family.
func buildOps(dp *bpf.Datapath) (reconciler.Operations[*tables.NodeAddress], error) {
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

func register(p datapath.ReconcilerParams, tbl statedb.RWTable[*tables.NodeAddress],
	ops reconciler.Operations[*tables.NodeAddress]) error {
	return datapath.Register(p, Name, tbl, (*tables.NodeAddress).Clone, (*tables.NodeAddress).SetStatus,
		(*tables.NodeAddress).GetStatus, ops)
}
