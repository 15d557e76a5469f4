package tables

import (
	"net/netip"
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// DatapathDeviceTableName is the name of the table of devices the
// masquerade programs are attached to.
const DatapathDeviceTableName = "datapath-devices"

// DatapathDevice is a device that gets the masquerade programs on its tc
// egress and ingress hooks, with the SNAT address per family the egress
// program translates to. It is derived from the selected egress-devices.
type DatapathDevice struct {
	Index  int        `json:"index" yaml:"index"`
	Name   string     `json:"name" yaml:"name"`
	SNATv4 netip.Addr `json:"snatv4" yaml:"snatv4"`
	SNATv6 netip.Addr `json:"snatv6" yaml:"snatv6"`
	// L3 is true for a device whose packets start at the network header
	// (tun, WireGuard, ...): it gets the programs' L3 variants.
	L3 bool `json:"l3" yaml:"l3"`
	// Status is the attach reconciliation status.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// TableHeader implements statedb.TableWritable.
func (d *DatapathDevice) TableHeader() []string {
	return []string{"Name", "Index", "SNATv4", "SNATv6", "L3", "Status"}
}

// TableRow implements statedb.TableWritable.
func (d *DatapathDevice) TableRow() []string {
	return []string{d.Name, strconv.Itoa(d.Index), addrString(d.SNATv4), addrString(d.SNATv6), strconv.FormatBool(d.L3), StatusString(d.Status)}
}

// Clone returns a shallow copy, as the reconciler requires.
func (d *DatapathDevice) Clone() *DatapathDevice {
	d2 := *d
	return &d2
}

// GetStatus returns the attach status.
func (d *DatapathDevice) GetStatus() reconciler.Status { return d.Status }

// SetStatus sets the attach status.
func (d *DatapathDevice) SetStatus(s reconciler.Status) *DatapathDevice {
	d.Status = s
	return d
}

// SameAs reports whether two rows describe the same attachment.
func (d *DatapathDevice) SameAs(o *DatapathDevice) bool {
	return d.Index == o.Index && d.Name == o.Name && d.SNATv4 == o.SNATv4 && d.SNATv6 == o.SNATv6 && d.L3 == o.L3
}

// DatapathDeviceByIndex is the primary index.
var DatapathDeviceByIndex = statedb.Index[*DatapathDevice, int]{
	Name: "index",
	FromObject: func(d *DatapathDevice) index.KeySet {
		return index.NewKeySet(index.Int(d.Index))
	},
	FromKey:    index.Int,
	FromString: index.IntString,
	Unique:     true,
}

// NewDatapathDeviceTable creates the datapath-devices table.
func NewDatapathDeviceTable(db *statedb.DB) (statedb.RWTable[*DatapathDevice], error) {
	return statedb.NewTable(db, DatapathDeviceTableName, DatapathDeviceByIndex)
}
