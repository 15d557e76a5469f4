package tables

import (
	"net/netip"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// MasqueradeSourceTableName is the name of the table of the source prefixes
// the datapath masquerades (maps masq_src_v4/v6).
const MasqueradeSourceTableName = "masquerade-sources"

// MasqueradeSource is a source prefix whose traffic the datapath
// masquerades on every selected device: a pod CIDR of an enabled family.
// (Masquerade rules' sources, per device, are MasqueradeRuleSource.)
type MasqueradeSource struct {
	// Prefix is the source prefix, without host bits.
	Prefix netip.Prefix `json:"prefix" yaml:"prefix"`
	// Status is the map reconciliation status.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// TableHeader implements statedb.TableWritable.
func (s *MasqueradeSource) TableHeader() []string { return []string{"Prefix", "Status"} }

// TableRow implements statedb.TableWritable.
func (s *MasqueradeSource) TableRow() []string {
	return []string{s.Prefix.String(), StatusString(s.Status)}
}

// Clone returns a shallow copy, as the reconciler requires.
func (s *MasqueradeSource) Clone() *MasqueradeSource {
	s2 := *s
	return &s2
}

// GetStatus returns the map reconciliation status.
func (s *MasqueradeSource) GetStatus() reconciler.Status { return s.Status }

// SetStatus sets the map reconciliation status.
func (s *MasqueradeSource) SetStatus(st reconciler.Status) *MasqueradeSource {
	s.Status = st
	return s
}

// MasqueradeSourceByPrefix is the primary index.
var MasqueradeSourceByPrefix = statedb.Index[*MasqueradeSource, netip.Prefix]{
	Name: "prefix",
	FromObject: func(s *MasqueradeSource) index.KeySet {
		return index.NewKeySet(index.NetIPPrefix(s.Prefix))
	},
	FromKey:    index.NetIPPrefix,
	FromString: index.NetIPPrefixString,
	Unique:     true,
}

// NewMasqueradeSourceTable creates the masquerade-sources table.
func NewMasqueradeSourceTable(db *statedb.DB) (statedb.RWTable[*MasqueradeSource], error) {
	return statedb.NewTable(db, MasqueradeSourceTableName, MasqueradeSourceByPrefix)
}
