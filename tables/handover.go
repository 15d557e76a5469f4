package tables

import (
	"fmt"
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// HandoverTableName is the name of the one-row table of the flow handover
// between conntrack and the datapath (reconcilers/handover).
const HandoverTableName = "conntrack-handover"

// Handover is the state and counts of the flow handover: while a netfilter
// NAT rule decides before ipmasq, conntrack's masquerade bindings are
// adopted as NAT pairs and the datapath's pairs handed back to conntrack,
// so that a migration from (or back to) the Kubernetes ip-masq-agent keeps
// every established flow (docs/migrate.md).
type Handover struct {
	// Enabled: --conntrack-handover.
	Enabled bool `json:"enabled" yaml:"enabled"`
	// Available: the kernel has the conntrack lookup the ingress program
	// needs (bpf_skb_ct_lookup); without it nothing is moved.
	Available bool `json:"available" yaml:"available"`
	// Active: a netfilter NAT rule decides before ipmasq, and the handover
	// runs.
	Active bool `json:"active" yaml:"active"`
	// Adopted and HandedBack count the flows moved each way since the
	// agent started; Failed those neither could move, the last one's error
	// in LastError.
	Adopted    uint64 `json:"adopted" yaml:"adopted"`
	HandedBack uint64 `json:"handedBack" yaml:"handedBack"`
	Failed     uint64 `json:"failed" yaml:"failed"`
	LastError  string `json:"lastError,omitempty" yaml:"lastError,omitempty"`
}

// Describe is the status line of the handover.
func (h *Handover) Describe() string {
	state := "idle (no netfilter NAT rule decides before ipmasq)"
	switch {
	case !h.Enabled:
		state = "off (--conntrack-handover=false)"
	case h.Active:
		state = "active (a netfilter NAT rule decides before ipmasq)"
	case !h.Available:
		state = "not possible: the kernel has no conntrack lookup for BPF (bpf_skb_ct_lookup); flows are not moved"
	}
	out := fmt.Sprintf("%s; %d flow(s) adopted from conntrack, %d handed back, %d failed", state, h.Adopted, h.HandedBack, h.Failed)
	if h.LastError != "" {
		out += " (last: " + h.LastError + ")"
	}
	return out
}

// TableHeader implements statedb.TableWritable.
func (h *Handover) TableHeader() []string {
	return []string{"Enabled", "Available", "Active", "Adopted", "HandedBack", "Failed", "LastError"}
}

// TableRow implements statedb.TableWritable.
func (h *Handover) TableRow() []string {
	return []string{strconv.FormatBool(h.Enabled), strconv.FormatBool(h.Available), strconv.FormatBool(h.Active),
		strconv.FormatUint(h.Adopted, 10), strconv.FormatUint(h.HandedBack, 10), strconv.FormatUint(h.Failed, 10), h.LastError}
}

// handoverKey is the one row's key.
const handoverKey = "handover"

// HandoverByKey is the primary index of the conntrack-handover table: its
// one row has the key "handover".
var HandoverByKey = statedb.Index[*Handover, string]{
	Name:       "key",
	FromObject: func(*Handover) index.KeySet { return index.NewKeySet(index.String(handoverKey)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// HandoverRow returns the table's row (nil before the handover wrote it).
func HandoverRow(txn statedb.ReadTxn, t statedb.Table[*Handover]) *Handover {
	h, _, _ := t.Get(txn, HandoverByKey.Query(handoverKey))
	return h
}

// NewHandoverTable creates the conntrack-handover table.
func NewHandoverTable(db *statedb.DB) (statedb.RWTable[*Handover], error) {
	return statedb.NewTable(db, HandoverTableName, HandoverByKey)
}
