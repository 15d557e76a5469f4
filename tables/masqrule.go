package tables

import (
	"net/netip"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// MasqueradeRuleTableName is the name of the table of the config's
// masqueradeRules.
const MasqueradeRuleTableName = "masquerade-rules"

// MasqueradeRule is a user rule of the config: masquerade traffic from
// Sources (not pods: e.g. VPN clients) when it leaves through one of
// OutInterfaces.
type MasqueradeRule struct {
	Name string `json:"name" yaml:"name"`
	// Sources are the source prefixes the rule masquerades.
	Sources []netip.Prefix `json:"sources" yaml:"sources"`
	// OutInterfaces are device names or "prefix+" patterns.
	OutInterfaces []string `json:"outInterfaces" yaml:"outInterfaces"`
	// ToAddress is the SNAT address; zero: the device's primary address.
	ToAddress netip.Addr `json:"toAddress" yaml:"toAddress"`
}

// TableHeader implements statedb.TableWritable.
func (r *MasqueradeRule) TableHeader() []string {
	return []string{"Name", "Sources", "OutInterfaces", "ToAddress"}
}

// TableRow implements statedb.TableWritable.
func (r *MasqueradeRule) TableRow() []string {
	srcs := make([]string, len(r.Sources))
	for i, s := range r.Sources {
		srcs[i] = s.String()
	}
	return []string{r.Name, strings.Join(srcs, ","), strings.Join(r.OutInterfaces, ","), addrString(r.ToAddress)}
}

// MatchesDevice reports whether the rule applies to traffic leaving
// through the named device.
func (r *MasqueradeRule) MatchesDevice(name string) bool {
	for _, pat := range r.OutInterfaces {
		if p, ok := strings.CutSuffix(pat, "+"); ok {
			if strings.HasPrefix(name, p) {
				return true
			}
		} else if pat == name {
			return true
		}
	}
	return false
}

// MasqueradeRuleByName is the primary index.
var MasqueradeRuleByName = statedb.Index[*MasqueradeRule, string]{
	Name: "name",
	FromObject: func(r *MasqueradeRule) index.KeySet {
		return index.NewKeySet(index.String(r.Name))
	},
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewMasqueradeRuleTable creates the masquerade-rules table.
func NewMasqueradeRuleTable(db *statedb.DB) (statedb.RWTable[*MasqueradeRule], error) {
	return statedb.NewTable(db, MasqueradeRuleTableName, MasqueradeRuleByName)
}

// MasqueradeRuleSourceTableName is the name of the table of rule sources resolved
// against the egress devices.
const MasqueradeRuleSourceTableName = "masquerade-rule-sources"

// MasqueradeRuleSource is one source prefix of a masquerade rule on one egress
// device, as the datapath's masq_rules maps hold it.
type MasqueradeRuleSource struct {
	Ifindex int          `json:"ifindex" yaml:"ifindex"`
	Device  string       `json:"device" yaml:"device"`
	Source  netip.Prefix `json:"source" yaml:"source"`
	// ToAddress is the SNAT address; zero: the device's primary address.
	ToAddress netip.Addr `json:"toAddress" yaml:"toAddress"`
	// Rule is the name of the rule the row comes from.
	Rule   string            `json:"rule" yaml:"rule"`
	Status reconciler.Status `json:"status" yaml:"status"`
}

// TableHeader implements statedb.TableWritable.
func (s *MasqueradeRuleSource) TableHeader() []string {
	return []string{"Device", "Source", "ToAddress", "Rule", "Status"}
}

// TableRow implements statedb.TableWritable.
func (s *MasqueradeRuleSource) TableRow() []string {
	return []string{s.Device, s.Source.String(), addrString(s.ToAddress), s.Rule, StatusString(s.Status)}
}

// Clone returns a shallow copy, as the reconciler requires.
func (s *MasqueradeRuleSource) Clone() *MasqueradeRuleSource {
	s2 := *s
	return &s2
}

// GetStatus returns the map reconciliation status.
func (s *MasqueradeRuleSource) GetStatus() reconciler.Status { return s.Status }

// SetStatus sets the map reconciliation status.
func (s *MasqueradeRuleSource) SetStatus(st reconciler.Status) *MasqueradeRuleSource {
	s.Status = st
	return s
}

// MasqueradeRuleSourceKey identifies a row: the device and the source prefix.
type MasqueradeRuleSourceKey struct {
	Ifindex int
	Source  netip.Prefix
}

func (k MasqueradeRuleSourceKey) indexKey() index.Key {
	return append(index.Int(k.Ifindex), index.NetIPPrefix(k.Source)...)
}

// MasqueradeRuleSourceByKey is the primary index: one row per device and source.
var MasqueradeRuleSourceByKey = statedb.Index[*MasqueradeRuleSource, MasqueradeRuleSourceKey]{
	Name: "key",
	FromObject: func(s *MasqueradeRuleSource) index.KeySet {
		return index.NewKeySet(MasqueradeRuleSourceKey{s.Ifindex, s.Source}.indexKey())
	},
	FromKey: MasqueradeRuleSourceKey.indexKey,
	Unique:  true,
}

// NewMasqueradeRuleSourceTable creates the masquerade-rule-sources table.
func NewMasqueradeRuleSourceTable(db *statedb.DB) (statedb.RWTable[*MasqueradeRuleSource], error) {
	return statedb.NewTable(db, MasqueradeRuleSourceTableName, MasqueradeRuleSourceByKey)
}
