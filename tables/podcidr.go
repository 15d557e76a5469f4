package tables

import (
	"net/netip"
	"slices"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// PodCIDRTableName is the name of the table of the node's pod address
// ranges: the IPAM pools and the masquerade sources.
const PodCIDRTableName = "pod-cidrs"

// PodCIDRSource says where a pod CIDR came from, and with it what it is
// for.
type PodCIDRSource string

const (
	// PodCIDRFromFlag is a --pod-cidr: an IPAM pool and a masquerade source.
	PodCIDRFromFlag PodCIDRSource = "flag"
	// PodCIDRFromKubernetes is one of the agent's Node's spec.podCIDRs (or
	// the copy of them kept on disk): an IPAM pool and a masquerade source.
	PodCIDRFromKubernetes PodCIDRSource = "kubernetes"
	// PodCIDRFromClusterCIDR is a --cluster-cidr: the whole cluster's pod
	// range, a masquerade source only (another CNI may do the IPAM).
	PodCIDRFromClusterCIDR PodCIDRSource = "cluster-cidr"
)

// PodCIDR is one pod address range of the node.
type PodCIDR struct {
	// Prefix is the range, masked.
	Prefix netip.Prefix `json:"prefix" yaml:"prefix"`
	// Source is where it came from.
	Source PodCIDRSource `json:"source" yaml:"source"`
}

// IsPool reports whether IPAM hands out addresses from the range.
func (c *PodCIDR) IsPool() bool { return c.Source != PodCIDRFromClusterCIDR }

// TableHeader implements statedb.TableWritable.
func (c *PodCIDR) TableHeader() []string { return []string{"Prefix", "Source"} }

// TableRow implements statedb.TableWritable.
func (c *PodCIDR) TableRow() []string { return []string{c.Prefix.String(), string(c.Source)} }

func podCIDRKey(p netip.Prefix, s PodCIDRSource) index.Key {
	return index.String(p.String() + " " + string(s))
}

var (
	// PodCIDRByPrefixSource is the primary index: one row per range and
	// source (the same range may come from two sources).
	PodCIDRByPrefixSource = statedb.Index[*PodCIDR, *PodCIDR]{
		Name: "prefix-source",
		FromObject: func(c *PodCIDR) index.KeySet {
			return index.NewKeySet(podCIDRKey(c.Prefix, c.Source))
		},
		FromKey:    func(c *PodCIDR) index.Key { return podCIDRKey(c.Prefix, c.Source) },
		FromString: index.FromString,
		Unique:     true,
	}
	// PodCIDRBySource lists the rows of one writer.
	PodCIDRBySource = statedb.Index[*PodCIDR, PodCIDRSource]{
		Name: "source",
		FromObject: func(c *PodCIDR) index.KeySet {
			return index.NewKeySet(index.String(string(c.Source)))
		},
		FromKey:    func(s PodCIDRSource) index.Key { return index.String(string(s)) },
		FromString: index.FromString,
		Unique:     false,
	}
)

// NewPodCIDRTable creates the pod-cidrs table.
func NewPodCIDRTable(db *statedb.DB) (statedb.RWTable[*PodCIDR], error) {
	return statedb.NewTable(db, PodCIDRTableName, PodCIDRByPrefixSource, PodCIDRBySource)
}

// SetPodCIDRs makes the rows of source exactly prefixes, leaving the other
// sources' rows alone. It reports whether anything changed.
func SetPodCIDRs(wtxn statedb.WriteTxn, tbl statedb.RWTable[*PodCIDR], source PodCIDRSource, prefixes []netip.Prefix) bool {
	want := map[netip.Prefix]bool{}
	for _, p := range prefixes {
		want[p.Masked()] = true
	}
	changed := false
	for row := range tbl.List(wtxn, PodCIDRBySource.Query(source)) {
		if !want[row.Prefix] {
			tbl.Delete(wtxn, row)
			changed = true
		}
		delete(want, row.Prefix)
	}
	for p := range want {
		tbl.Insert(wtxn, &PodCIDR{Prefix: p, Source: source})
		changed = true
	}
	return changed
}

// PoolPrefixes are the ranges IPAM allocates from, sorted (IPv4 first).
func PoolPrefixes(txn statedb.ReadTxn, tbl statedb.Table[*PodCIDR]) []netip.Prefix {
	return podPrefixes(txn, tbl, (*PodCIDR).IsPool)
}

// MasqueradeSources are the ranges whose traffic is masqueraded: every
// row, deduplicated and sorted (IPv4 first).
func MasqueradeSources(txn statedb.ReadTxn, tbl statedb.Table[*PodCIDR]) []netip.Prefix {
	return podPrefixes(txn, tbl, func(*PodCIDR) bool { return true })
}

func podPrefixes(txn statedb.ReadTxn, tbl statedb.Table[*PodCIDR], keep func(*PodCIDR) bool) []netip.Prefix {
	var out []netip.Prefix
	for row := range tbl.All(txn) {
		if keep(row) && !slices.Contains(out, row.Prefix) {
			out = append(out, row.Prefix)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	return out
}
