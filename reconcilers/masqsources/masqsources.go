// Package masqsources writes table masquerade-sources (the source prefixes
// and whether their packets are masqueraded) into the datapath's LPM maps
// masq_src_v4/v6. It is built like reconcilers/nodeaddrs.
package masqsources

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
const Name = "masq-sources"

// Cell reconciles masquerade-sources into masq_src_v4/v6. It needs
// datapath.Cell (the loaded datapath) and the masquerade-sources table
// (cells/datapathtables).
var Cell = cell.Group(
	// The Operations, in the hive so that tests decorate them.
	cell.Provide(newOps),
	cell.Invoke(register),
)

// entries writes each prefix into the trie of its family.
var entries = bpfmap.Entries[*tables.MasqueradeSource, bpf.LPMKeyV4, bpf.LPMKeyV6, uint8]{
	MapV4: bpf.MapMasqSrcV4, MapV6: bpf.MapMasqSrcV6,
	Is4: func(s *tables.MasqueradeSource) bool { return s.Prefix.Addr().Is4() },
	V4: func(s *tables.MasqueradeSource) (bpf.LPMKeyV4, uint8) {
		return bpf.LPMKeyV4From(s.Prefix), flags(s)
	},
	V6: func(s *tables.MasqueradeSource) (bpf.LPMKeyV6, uint8) {
		return bpf.LPMKeyV6From(s.Prefix), flags(s)
	},
	Name: func(s *tables.MasqueradeSource) string { return s.Prefix.String() },
}

// flags is the entry's masq_src value.
func flags(s *tables.MasqueradeSource) uint8 {
	var f uint8
	if s.Masquerade {
		f |= bpf.MasqSrcMasquerade
	}
	if s.Rules {
		f |= bpf.MasqSrcRules
	}
	return f
}

func newOps(h *datapath.Handle) reconciler.Operations[*tables.MasqueradeSource] {
	return bpfmap.NewOps(h, entries)
}

func register(p datapath.ReconcilerParams, tbl statedb.RWTable[*tables.MasqueradeSource],
	ops reconciler.Operations[*tables.MasqueradeSource]) error {
	return datapath.Register(p, Name, tbl, (*tables.MasqueradeSource).Clone, (*tables.MasqueradeSource).SetStatus,
		(*tables.MasqueradeSource).GetStatus, ops)
}
