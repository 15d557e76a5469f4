package tables

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// PodCIDRTableName is the name of the table of the node's pod CIDRs.
const PodCIDRTableName = "pod-cidrs"

// PodCIDROrigin says where a pod CIDR came from. Each origin has one writer,
// which owns the rows of its origin and registers its own initializer, so
// readers wait for every origin with Table.Initialized.
type PodCIDROrigin string

const (
	// PodCIDRFromFlag is a --pod-cidr value: an IPAM pool and a masquerade
	// source.
	PodCIDRFromFlag PodCIDROrigin = "flag"
	// PodCIDRFromKubernetes is one of the agent's Node's spec.podCIDRs (or
	// the copy of them kept on disk): an IPAM pool and a masquerade source.
	PodCIDRFromKubernetes PodCIDROrigin = "kubernetes"
	// PodCIDRFromClusterCIDR is a --cluster-cidr value: the whole cluster's
	// pod range, a masquerade source only (another CNI may do the IPAM).
	PodCIDRFromClusterCIDR PodCIDROrigin = "cluster-cidr"
)

// PodCIDR is one pool of endpoint addresses on this node: IPAM allocates
// from it, and the datapath masquerades traffic from it.
type PodCIDR struct {
	// Prefix is the pool, as its origin gave it.
	Prefix netip.Prefix `json:"prefix" yaml:"prefix"`
	// Origin is where the prefix came from.
	Origin PodCIDROrigin `json:"origin" yaml:"origin"`
	// Position is the prefix's place in its origin's list (the order of the
	// --pod-cidr flags): IPAM fills the pools of a family in this order.
	Position int `json:"position" yaml:"position"`
}

// IsPool reports whether IPAM hands out addresses from the prefix.
func (c *PodCIDR) IsPool() bool { return c.Origin != PodCIDRFromClusterCIDR }

// TableHeader implements statedb.TableWritable.
func (c *PodCIDR) TableHeader() []string { return []string{"Prefix", "Origin", "Position"} }

// TableRow implements statedb.TableWritable.
func (c *PodCIDR) TableRow() []string {
	return []string{c.Prefix.String(), string(c.Origin), strconv.Itoa(c.Position)}
}

// PodCIDRKey identifies a row: two origins may name the same prefix.
type PodCIDRKey struct {
	Prefix netip.Prefix
	Origin PodCIDROrigin
}

func (k PodCIDRKey) indexKey() index.Key {
	return append(index.NetIPPrefix(k.Prefix), index.String(string(k.Origin))...)
}

var (
	// PodCIDRByKey is the primary index: one row per prefix and origin.
	PodCIDRByKey = statedb.Index[*PodCIDR, PodCIDRKey]{
		Name: "key",
		FromObject: func(c *PodCIDR) index.KeySet {
			return index.NewKeySet(PodCIDRKey{c.Prefix, c.Origin}.indexKey())
		},
		FromKey: PodCIDRKey.indexKey,
		Unique:  true,
	}
	// PodCIDRByOrigin lists the rows of one origin (its writer's rows).
	PodCIDRByOrigin = statedb.Index[*PodCIDR, PodCIDROrigin]{
		Name: "origin",
		FromObject: func(c *PodCIDR) index.KeySet {
			return index.NewKeySet(index.String(string(c.Origin)))
		},
		FromKey:    func(s PodCIDROrigin) index.Key { return index.String(string(s)) },
		FromString: index.FromString,
		Unique:     false,
	}
)

// NewPodCIDRTable creates the pod-cidrs table.
func NewPodCIDRTable(db *statedb.DB) (statedb.RWTable[*PodCIDR], error) {
	return statedb.NewTable(db, PodCIDRTableName, PodCIDRByKey, PodCIDRByOrigin)
}

// PodCIDRPrefixes lists the distinct pod CIDR prefixes of all origins,
// ordered by position, then origin: with only --pod-cidr, the flags' order.
// These are the masquerade sources.
func PodCIDRPrefixes(txn statedb.ReadTxn, tbl statedb.Table[*PodCIDR]) []netip.Prefix {
	return podCIDRPrefixes(txn, tbl, func(*PodCIDR) bool { return true })
}

// PoolPrefixes lists the distinct prefixes IPAM allocates from (every
// origin but --cluster-cidr), in the order of PodCIDRPrefixes.
func PoolPrefixes(txn statedb.ReadTxn, tbl statedb.Table[*PodCIDR]) []netip.Prefix {
	return podCIDRPrefixes(txn, tbl, (*PodCIDR).IsPool)
}

// SetPodCIDRs makes the rows of origin exactly prefixes, at positions in
// their order, leaving the other origins' rows alone. It reports whether
// anything changed.
func SetPodCIDRs(wtxn statedb.WriteTxn, tbl statedb.RWTable[*PodCIDR], origin PodCIDROrigin, prefixes []netip.Prefix) bool {
	want := map[PodCIDRKey]int{}
	for i, p := range prefixes {
		if _, dup := want[PodCIDRKey{p, origin}]; !dup {
			want[PodCIDRKey{p, origin}] = i
		}
	}
	changed := false
	for row := range tbl.List(wtxn, PodCIDRByOrigin.Query(origin)) {
		pos, keep := want[PodCIDRKey{row.Prefix, origin}]
		if !keep || pos != row.Position {
			tbl.Delete(wtxn, row)
			changed = true
			continue
		}
		delete(want, PodCIDRKey{row.Prefix, origin})
	}
	for k, pos := range want {
		tbl.Insert(wtxn, &PodCIDR{Prefix: k.Prefix, Origin: origin, Position: pos})
		changed = true
	}
	return changed
}

func podCIDRPrefixes(txn statedb.ReadTxn, tbl statedb.Table[*PodCIDR], keep func(*PodCIDR) bool) []netip.Prefix {
	rows := statedb.Collect(tbl.All(txn))
	slices.SortStableFunc(rows, func(a, b *PodCIDR) int {
		return cmp.Or(cmp.Compare(a.Position, b.Position), cmp.Compare(a.Origin, b.Origin))
	})
	var out []netip.Prefix
	seen := map[netip.Prefix]bool{}
	for _, c := range rows {
		if keep(c) && !seen[c.Prefix] {
			seen[c.Prefix] = true
			out = append(out, c.Prefix)
		}
	}
	return out
}

// KubernetesPodCIDRsDone marks the pod-cidrs table initialized for the
// Node's ranges: the table's owner (cells/podcidrs) provides it, and the
// Node watcher (cells/k8snode) calls it in the write transaction that
// first writes the Node's ranges (from the API server or from the copy on
// disk), so that neither writer imports the other. Without Kubernetes it
// does nothing.
type KubernetesPodCIDRsDone func(statedb.WriteTxn)

// ValidatePools checks prefixes that are to become address pools (the
// --pod-cidr flags, the Node's spec.podCIDRs): each must be masked, must
// not overlap another, and must leave room for at least one (IPv4, /30) or
// two (IPv6, /126) usable addresses. IPv4-mapped IPv6 prefixes are
// rejected: write them as IPv4. The writers of the pod-cidrs table check
// their input with it before a row is written, so the IPAM never meets a
// pool it cannot use.
func ValidatePools(cidrs []netip.Prefix) error {
	for i, c := range cidrs {
		if err := checkPool(c); err != nil {
			return err
		}
		for _, prev := range cidrs[:i] {
			if c.Overlaps(prev) {
				return fmt.Errorf("--pod-cidr %s overlaps --pod-cidr %s; pools must be disjoint", c, prev)
			}
		}
	}
	return nil
}

func checkPool(c netip.Prefix) error {
	if !c.IsValid() {
		return fmt.Errorf("--pod-cidr %s is not a valid prefix; expected e.g. 10.244.1.0/24 or fd00:10:244:1::/64", c)
	}
	addr := c.Addr()
	if addr.Is4In6() {
		hint := ""
		if c.Bits() >= 96 {
			hint = fmt.Sprintf("; write it as IPv4: %s", netip.PrefixFrom(addr.Unmap(), c.Bits()-96).Masked())
		}
		return fmt.Errorf("--pod-cidr %s is an IPv4-mapped IPv6 prefix%s", c, hint)
	}
	if addr.Zone() != "" {
		return fmt.Errorf("--pod-cidr %s has a zone; pools cannot have one", c)
	}
	if m := c.Masked(); m != c {
		return fmt.Errorf("--pod-cidr %s has host bits set; did you mean %s?", c, m)
	}
	if addr.Is4() && c.Bits() > 30 {
		return fmt.Errorf("--pod-cidr %s is too small: an IPv4 pool must be /30 or larger (1 usable address)", c)
	}
	if addr.Is6() && c.Bits() > 126 {
		return fmt.Errorf("--pod-cidr %s is too small: an IPv6 pool must be /126 or larger (2 usable addresses)", c)
	}
	return nil
}
