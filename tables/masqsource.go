package tables

import (
	"iter"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// MasqueradeSourceTableName is the name of the table of the source prefixes
// the datapath masquerades (maps masq_src_v4/v6).
const MasqueradeSourceTableName = "masquerade-sources"

// MasqueradeSource is an entry of masq_src_v4/v6: a source prefix and what
// its packets are on every device the datapath is attached to, whatever
// longer entry inside it says for its own part (longest prefix wins, so
// each entry carries the flags of every prefix that covers it). By default
// 0.0.0.0/0 and ::/0 are masqueraded and each node address is an entry that
// is not, nor are the unspecified and IPv6 link-local sources; with
// --masquerade-pod-cidrs-only the pod CIDRs are. Masquerade
// rules' sources, per device, are MasqueradeRuleSource; here they only mark
// their prefixes (Rules) so that the datapath looks the rule up.
type MasqueradeSource struct {
	// Prefix is the source prefix, without host bits.
	Prefix netip.Prefix `json:"prefix" yaml:"prefix"`
	// Masquerade says whether packets from the prefix are masqueraded.
	Masquerade bool `json:"masquerade" yaml:"masquerade"`
	// Rules says whether a masquerade rule covers the prefix: the datapath
	// looks up masq_rules_* first, and a rule for the device wins.
	Rules bool `json:"rules" yaml:"rules"`
	// Origin says why the entry exists: OriginEverySource,
	// OriginPodCIDR, OriginNodeAddress, OriginMasqueradeRule or
	// OriginLinkOnly.
	Origin SourceOrigin `json:"origin" yaml:"origin"`
	// Status is the map reconciliation status.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// SourceOrigin says why a masquerade-sources entry exists.
type SourceOrigin string

// The origins of masquerade-sources entries.
const (
	// OriginEverySource: 0.0.0.0/0 or ::/0, the default (upstream's
	// semantics: every forwarded source but the node's own addresses).
	OriginEverySource SourceOrigin = "every-source"
	// OriginPodCIDR: a pod CIDR (--masquerade-pod-cidrs-only).
	OriginPodCIDR SourceOrigin = "pod-cidr"
	// OriginNodeAddress: one of the node's own addresses, never a
	// masquerade source (the node's own traffic stays as it is).
	OriginNodeAddress SourceOrigin = "node-address"
	// OriginMasqueradeRule: a masquerade rule's source.
	OriginMasqueradeRule SourceOrigin = "masquerade-rule"
	// OriginLinkOnly: 0.0.0.0/32, ::/128 or fe80::/10, sources only the
	// node sends from, for the link alone (duplicate address detection,
	// MLD, neighbour discovery, DHCP): never masqueraded, nor translated
	// by a rule.
	OriginLinkOnly SourceOrigin = "link-only"
)

// SameAs reports whether two rows hold the same entry.
func (s *MasqueradeSource) SameAs(o *MasqueradeSource) bool {
	return s.Prefix == o.Prefix && s.Masquerade == o.Masquerade && s.Rules == o.Rules && s.Origin == o.Origin
}

// TableHeader implements statedb.TableWritable.
func (s *MasqueradeSource) TableHeader() []string {
	return []string{"Prefix", "Masquerade", "Rules", "Origin", "Status"}
}

// TableRow implements statedb.TableWritable.
func (s *MasqueradeSource) TableRow() []string {
	return []string{s.Prefix.String(), strconv.FormatBool(s.Masquerade), strconv.FormatBool(s.Rules), string(s.Origin), StatusString(s.Status)}
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

// DescribeMasqueradeSources says in one line which sources the rows of
// masquerade-sources masquerade, for the log, health and status.
func DescribeMasqueradeSources(rows iter.Seq2[*MasqueradeSource, statedb.Revision]) string {
	var every, pods []string
	nodes, rules := 0, 0
	for r := range rows {
		switch r.Origin {
		case OriginEverySource:
			every = append(every, r.Prefix.String())
		case OriginPodCIDR:
			pods = append(pods, r.Prefix.String())
		case OriginNodeAddress:
			nodes++
		}
		if r.Rules && r.Origin == OriginMasqueradeRule {
			rules++
		}
	}
	var b strings.Builder
	switch {
	case len(every) > 0:
		b.WriteString("every forwarded source (" + strings.Join(every, ", ") + ") but the node's own " + strconv.Itoa(nodes) + " address(es)")
	case len(pods) > 0:
		slices.Sort(pods)
		b.WriteString("the pod CIDRs only (--masquerade-pod-cidrs-only): " + strings.Join(pods, ", "))
	default:
		b.WriteString("NONE: --masquerade-pod-cidrs-only and no pod CIDR known, pods leave unmasqueraded")
	}
	if rules > 0 {
		b.WriteString("; " + strconv.Itoa(rules) + " prefix(es) of masquerade rules looked up first")
	}
	return b.String()
}
