// Package tables holds the StateDB row types of ipmasq, their indexes and
// table constructors. It does no I/O: cells write these tables, reconcilers
// read them and write the kernel.
package tables

import (
	"fmt"
	"net/netip"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// NonMasqCIDRTableName is the name of the table of destination prefixes
// with their masquerade action.
const NonMasqCIDRTableName = "nonmasq-cidrs"

// Action is what the datapath does with traffic whose destination's longest
// matching prefix is the row's prefix. Its numeric value is the value stored
// in the nonmasq_v4/v6 BPF maps.
type Action uint8

const (
	// ActionNoMasquerade leaves the source address untouched.
	ActionNoMasquerade Action = 0
	// ActionMasquerade translates the source to the egress address. It is
	// used by masqueradeCIDRs: exceptions inside a non-masquerade range.
	ActionMasquerade Action = 1
)

func (a Action) String() string {
	switch a {
	case ActionNoMasquerade:
		return "no-masquerade"
	case ActionMasquerade:
		return "masquerade"
	}
	return fmt.Sprintf("action(%d)", uint8(a))
}

// MarshalText implements encoding.TextMarshaler.
func (a Action) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (a *Action) UnmarshalText(b []byte) error {
	switch string(b) {
	case "no-masquerade":
		*a = ActionNoMasquerade
	case "masquerade":
		*a = ActionMasquerade
	default:
		return fmt.Errorf("unknown action %q, expected no-masquerade or masquerade", b)
	}
	return nil
}

// Origin says where a prefix in the nonmasq-cidrs table came from.
type Origin uint8

const (
	// OriginConfig is a prefix listed in the config file.
	OriginConfig Origin = iota
	// OriginDefault is one of the reserved ranges used when the file is
	// absent, empty or does not set nonMasqueradeCIDRs.
	OriginDefault
	// OriginLinkLocal is 169.254.0.0/16 or fe80::/10, added unless
	// masqLinkLocal / masqLinkLocalIPv6 is true.
	OriginLinkLocal
)

func (o Origin) String() string {
	switch o {
	case OriginConfig:
		return "config"
	case OriginDefault:
		return "default"
	case OriginLinkLocal:
		return "link-local"
	}
	return fmt.Sprintf("origin(%d)", uint8(o))
}

// MarshalText implements encoding.TextMarshaler.
func (o Origin) MarshalText() ([]byte, error) { return []byte(o.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (o *Origin) UnmarshalText(b []byte) error {
	for _, c := range []Origin{OriginConfig, OriginDefault, OriginLinkLocal} {
		if c.String() == string(b) {
			*o = c
			return nil
		}
	}
	return fmt.Errorf("unknown origin %q, expected config, default or link-local", b)
}

// NonMasqCIDR is one destination prefix of the masquerade decision: traffic
// to an address whose longest match is this prefix gets Action.
type NonMasqCIDR struct {
	Prefix netip.Prefix      `json:"prefix" yaml:"prefix"`
	Action Action            `json:"action" yaml:"action"`
	Origin Origin            `json:"origin" yaml:"origin"`
	Status reconciler.Status `json:"status" yaml:"status"`
}

// TableHeader implements statedb.TableWritable.
func (c *NonMasqCIDR) TableHeader() []string {
	return []string{"Prefix", "Action", "Origin", "Status"}
}

// TableRow implements statedb.TableWritable.
func (c *NonMasqCIDR) TableRow() []string {
	return []string{c.Prefix.String(), c.Action.String(), c.Origin.String(), StatusString(c.Status)}
}

// Clone returns a shallow copy, as the reconciler requires.
func (c *NonMasqCIDR) Clone() *NonMasqCIDR {
	c2 := *c
	return &c2
}

// GetStatus returns the BPF map reconciliation status.
func (c *NonMasqCIDR) GetStatus() reconciler.Status { return c.Status }

// SetStatus sets the BPF map reconciliation status.
func (c *NonMasqCIDR) SetStatus(s reconciler.Status) *NonMasqCIDR {
	c.Status = s
	return c
}

var (
	// NonMasqCIDRByPrefix is the primary index: exactly one row per prefix.
	NonMasqCIDRByPrefix = statedb.Index[*NonMasqCIDR, netip.Prefix]{
		Name: "prefix",
		FromObject: func(c *NonMasqCIDR) index.KeySet {
			return index.NewKeySet(prefixKey(c.Prefix))
		},
		FromKey:    prefixKey,
		FromString: index.NetIPPrefixString,
		Unique:     true,
	}
)

// prefixKey is index.NetIPPrefix (the 16-byte address, then the prefix
// length) in one allocation instead of two: the key is computed for every
// insert and status commit, 16 384 of each per new config.
func prefixKey(p netip.Prefix) index.Key {
	a := p.Masked().Addr().As16()
	k := make(index.Key, 17)
	copy(k, a[:])
	k[16] = uint8(p.Bits())
	return k
}

// NewNonMasqCIDRTable creates the nonmasq-cidrs table.
func NewNonMasqCIDRTable(db *statedb.DB) (statedb.RWTable[*NonMasqCIDR], error) {
	// Longest-prefix matches are answered by probing this index once per
	// prefix length (LongestMatch): an lpm secondary index was reindexed on
	// every insert, status commits included, and cost about half of the
	// time from a config file to the maps.
	return statedb.NewTable(db, NonMasqCIDRTableName, NonMasqCIDRByPrefix)
}
