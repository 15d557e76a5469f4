// Package podcidrs writes the node's pod CIDRs from --pod-cidr into table
// pod-cidrs, the one place IPAM (its pools) and the datapath (its
// masquerade sources) read them from.
//
//	--pod-cidr ──▶ [pod-cidrs cell] ──▶ table pod-cidrs ──▶ IPAM pools, masquerade sources
//
// Rows carry their source (tables.PodCIDRFromFlag here), so that other
// writers (e.g. a Kubernetes Node's spec.podCIDRs) add theirs next to the
// flag's: each writer owns its source's rows and registers its own
// initializer on the table in its constructor.
package podcidrs

import (
	"fmt"
	"net/netip"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/tables"
)

// Config is the pod-cidrs cell's command-line configuration.
type Config struct {
	// PodCIDR are the pools endpoint addresses are allocated from.
	PodCIDR []string
}

// DefaultConfig is the configuration used when no flag is given: no pools.
var DefaultConfig = Config{}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.StringSlice("pod-cidr", def.PodCIDR, "Pool of endpoint addresses (repeatable; IPv4 and IPv6)")
}

// Cell provides table pod-cidrs with the --pod-cidr rows in it.
var Cell = cell.Module(
	"pod-cidrs",
	"Pod CIDRs from --pod-cidr",

	cell.Config(DefaultConfig),
	cell.Provide(
		newTable,
		statedb.RWTable[*tables.PodCIDR].ToTable,
	),
)

// Parse turns the --pod-cidr values into rows, in the flags' order.
func Parse(values []string) ([]*tables.PodCIDR, error) {
	rows := make([]*tables.PodCIDR, 0, len(values))
	for i, s := range values {
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("--pod-cidr %q is not a CIDR (want e.g. 10.244.1.0/24 or fd00:10:244:1::/64)", s)
		}
		rows = append(rows, &tables.PodCIDR{Prefix: pfx, Source: tables.PodCIDRFromFlag, Position: i})
	}
	return rows, nil
}

// newTable creates the table and writes the flag's rows before anything
// reads it, so that a reader built after it (IPAM restoring its state) sees
// them even in its constructor. The flag's initializer is done at once:
// the flag never changes while the agent runs.
func newTable(db *statedb.DB, cfg Config) (statedb.RWTable[*tables.PodCIDR], error) {
	rows, err := Parse(cfg.PodCIDR)
	if err != nil {
		return nil, err
	}
	tbl, err := tables.NewPodCIDRTable(db)
	if err != nil {
		return nil, err
	}
	wtxn := db.WriteTxn(tbl)
	done := tbl.RegisterInitializer(wtxn, string(tables.PodCIDRFromFlag))
	for _, r := range rows {
		if _, _, err := tbl.Insert(wtxn, r); err != nil {
			wtxn.Abort()
			return nil, fmt.Errorf("insert pod CIDR %s: %w", r.Prefix, err)
		}
	}
	done(wtxn)
	wtxn.Commit()
	return tbl, nil
}
