package tables

import (
	"fmt"
	"iter"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// NetfilterNATTableName is the name of the table of the netfilter NAT rules
// that decide before the datapath.
const NetfilterNATTableName = "netfilter-nat-rules"

// NetfilterNATKind says what was found.
type NetfilterNATKind string

const (
	// NetfilterIPMasqAgentChain is a chain named IP-MASQ-AGENT: the
	// Kubernetes ip-masq-agent's chain, left behind or still maintained.
	NetfilterIPMasqAgentChain NetfilterNATKind = "ip-masq-agent-chain"
	// NetfilterMasquerade is a MASQUERADE rule (iptables-nft's target or
	// nftables' masq) matching a masquerade source, or every source.
	NetfilterMasquerade NetfilterNATKind = "masquerade"
	// NetfilterSNAT is an SNAT rule matching a masquerade source, or every
	// source.
	NetfilterSNAT NetfilterNATKind = "snat"
	// NetfilterLegacyNATTable is an iptables-legacy nat table: its rules
	// cannot be read over netlink, only its presence is known.
	NetfilterLegacyNATTable NetfilterNATKind = "legacy-nat-table"
)

// NetfilterNATRule is a netfilter NAT rule or chain that decides before
// ipmasq: netfilter's POSTROUTING runs before the tc egress programs, so a
// packet it masquerades reaches them with the node's address as source and
// is never decided by the config. The agent only reads these; it never
// edits netfilter.
type NetfilterNATRule struct {
	// Family is the nftables family (ip, ip6, inet), or "legacy-ipv4" and
	// "legacy-ipv6" for iptables-legacy tables.
	Family string `json:"family" yaml:"family"`
	// Table and Chain name where the rule is (Chain is empty for a legacy table).
	Table string `json:"table" yaml:"table"`
	Chain string `json:"chain" yaml:"chain"`
	// Handle is the rule's nftables handle (0 for a chain or a legacy table).
	Handle uint64 `json:"handle" yaml:"handle"`
	// Kind is what was found.
	Kind NetfilterNATKind `json:"kind" yaml:"kind"`
	// Sources are the sources the rule matches: "any", a prefix, or "not
	// <prefix>"; empty for a chain or a legacy table.
	Sources string `json:"sources" yaml:"sources"`
}

// Key is the row's primary key.
func (r *NetfilterNATRule) Key() string {
	return r.Family + "/" + r.Table + "/" + r.Chain + "/" + strconv.FormatUint(r.Handle, 10) + "/" + string(r.Kind)
}

// TableHeader implements statedb.TableWritable.
func (r *NetfilterNATRule) TableHeader() []string {
	return []string{"Family", "Table", "Chain", "Handle", "Kind", "Sources"}
}

// TableRow implements statedb.TableWritable.
func (r *NetfilterNATRule) TableRow() []string {
	return []string{r.Family, r.Table, r.Chain, strconv.FormatUint(r.Handle, 10), string(r.Kind), r.Sources}
}

// NetfilterNATRuleByKey is the primary index.
var NetfilterNATRuleByKey = statedb.Index[*NetfilterNATRule, string]{
	Name: "key",
	FromObject: func(r *NetfilterNATRule) index.KeySet {
		return index.NewKeySet(index.String(r.Key()))
	},
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewNetfilterNATRuleTable creates the netfilter-nat-rules table.
func NewNetfilterNATRuleTable(db *statedb.DB) (statedb.RWTable[*NetfilterNATRule], error) {
	return statedb.NewTable(db, NetfilterNATTableName, NetfilterNATRuleByKey)
}

// String is the rule as an operator looks it up: family, table, chain,
// handle (nft -a list ruleset), kind and sources.
func (r *NetfilterNATRule) String() string {
	switch {
	case r.Kind == NetfilterLegacyNATTable:
		return fmt.Sprintf("%s table %s (iptables-legacy: see iptables-legacy-save -t %s)", r.Family, r.Table, r.Table)
	case r.Handle == 0:
		return fmt.Sprintf("%s %s chain %s (%s)", r.Family, r.Table, r.Chain, r.Kind)
	}
	return fmt.Sprintf("%s %s %s handle %d: %s from %s", r.Family, r.Table, r.Chain, r.Handle, r.Kind, r.Sources)
}

// DescribeNetfilterNATRules joins the rules' descriptions, sorted; empty
// for none.
func DescribeNetfilterNATRules(rows []*NetfilterNATRule) string {
	parts := make([]string, 0, len(rows))
	for _, r := range rows {
		parts = append(parts, r.String())
	}
	slices.Sort(parts)
	return strings.Join(parts, "; ")
}

// NetfilterNATRules collects rows, e.g. from Table.All.
func NetfilterNATRules(rows iter.Seq2[*NetfilterNATRule, statedb.Revision]) []*NetfilterNATRule {
	var out []*NetfilterNATRule
	for r := range rows {
		out = append(out, r)
	}
	return out
}
