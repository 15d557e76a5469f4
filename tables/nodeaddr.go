package tables

import (
	"net/netip"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// NodeAddressTableName is the name of the table of the node's own
// addresses (maps node_addrs_v4/v6).
const NodeAddressTableName = "node-addresses"

// NodeAddress is an address of a device of this node: traffic to it is
// never masqueraded.
type NodeAddress struct {
	Addr netip.Addr `json:"addr" yaml:"addr"`
	// Status is the map reconciliation status.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// TableHeader implements statedb.TableWritable.
func (a *NodeAddress) TableHeader() []string { return []string{"Address", "Status"} }

// TableRow implements statedb.TableWritable.
func (a *NodeAddress) TableRow() []string {
	return []string{a.Addr.String(), StatusString(a.Status)}
}

// Clone returns a shallow copy, as the reconciler requires.
func (a *NodeAddress) Clone() *NodeAddress {
	a2 := *a
	return &a2
}

// GetStatus returns the map reconciliation status.
func (a *NodeAddress) GetStatus() reconciler.Status { return a.Status }

// SetStatus sets the map reconciliation status.
func (a *NodeAddress) SetStatus(st reconciler.Status) *NodeAddress {
	a.Status = st
	return a
}

// NodeAddressByAddr is the primary index.
var NodeAddressByAddr = statedb.Index[*NodeAddress, netip.Addr]{
	Name: "addr",
	FromObject: func(a *NodeAddress) index.KeySet {
		return index.NewKeySet(index.NetIPAddr(a.Addr))
	},
	FromKey:    index.NetIPAddr,
	FromString: index.NetIPAddrString,
	Unique:     true,
}

// NewNodeAddressTable creates the node-addresses table.
func NewNodeAddressTable(db *statedb.DB) (statedb.RWTable[*NodeAddress], error) {
	return statedb.NewTable(db, NodeAddressTableName, NodeAddressByAddr)
}
