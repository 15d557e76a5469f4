// Package podcidrs provides table pod-cidrs, the one place IPAM (its pools)
// and the datapath (its masquerade sources) read the node's pod CIDRs from,
// and writes the ones given on the command line into it:
//
//	--pod-cidr     ──▶ [pod-cidrs cell] ──▶ table pod-cidrs ──▶ IPAM pools, masquerade sources
//	--cluster-cidr ──▶ [pod-cidrs cell] ──▶ table pod-cidrs ──▶ masquerade sources only
//	Node spec.podCIDRs ──▶ [k8s-node cell] ──▶ table pod-cidrs ──▶ IPAM pools, masquerade sources
//
// Rows carry their origin (tables.PodCIDRFromFlag, PodCIDRFromClusterCIDR
// here, PodCIDRFromKubernetes from cells/k8snode): each writer owns its
// origin's rows. With --k8s-node-name the table is initialized only once
// the Node's ranges are known (tables.KubernetesPodCIDRsDone).
package podcidrs

import (
	"fmt"
	"net/netip"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/internal/kubeclient"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Config is the pod-cidrs cell's command-line configuration.
type Config struct {
	// PodCIDR are the pools endpoint addresses are allocated from
	// (standalone mode).
	PodCIDR []string `mapstructure:"pod-cidr"`
	// ClusterCIDR are masquerade sources that are not pools.
	ClusterCIDR []string `mapstructure:"cluster-cidr"`
}

// DefaultConfig is the configuration used when no flag is given: no pools.
var DefaultConfig = Config{}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.StringSlice("pod-cidr", def.PodCIDR, "Pool of endpoint addresses and masquerade source (repeatable; IPv4 and IPv6); not with --k8s-node-name, which takes the Node's spec.podCIDRs")
	flags.StringSlice("cluster-cidr", def.ClusterCIDR, "Pod range of the whole cluster, as kube-proxy's --cluster-cidr: traffic from it is masqueraded, no address is allocated from it (repeatable)")
}

// Cell provides table pod-cidrs with the flags' rows in it.
var Cell = cell.Module(
	"pod-cidrs",
	"Pod CIDRs from the flags",

	cell.Config(DefaultConfig),
	cell.Provide(
		newTable,
		statedb.RWTable[*tables.PodCIDR].ToTable,
	),
)

type params struct {
	cell.In

	DB     *statedb.DB
	Config Config
	Agent  settings.Config
	Client *kubeclient.Client
}

// Parse turns flag values into rows of origin, in the flags' order. Ranges
// of a disabled family are dropped: the agent does nothing for that family.
func Parse(flag string, values []string, origin tables.PodCIDROrigin, agent settings.Config) ([]*tables.PodCIDR, error) {
	rows := make([]*tables.PodCIDR, 0, len(values))
	for i, s := range values {
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("%s %q is not a CIDR (want e.g. 10.244.1.0/24 or fd00:10:244:1::/64)", flag, s)
		}
		if m := pfx.Masked(); m != pfx {
			return nil, fmt.Errorf("%s %s has host bits set; did you mean %s?", flag, pfx, m)
		}
		if (pfx.Addr().Is4() && !agent.EnableIPv4) || (pfx.Addr().Is6() && !agent.EnableIPv6) {
			continue
		}
		rows = append(rows, &tables.PodCIDR{Prefix: pfx, Origin: origin, Position: i})
	}
	return rows, nil
}

// newTable creates the table and writes the flags' rows before anything
// reads it, so that a reader built after it (IPAM restoring its state) sees
// them even in its constructor. The flags' initializer is done at once (they
// never change while the agent runs); with a node name the table waits for
// the Node watcher's as well, registered here in the same transaction so
// that no reader sees the table initialized before the Node is known.
func newTable(p params) (statedb.RWTable[*tables.PodCIDR], tables.KubernetesPodCIDRsDone, error) {
	agent := p.Agent
	pools, err := Parse("--pod-cidr", p.Config.PodCIDR, tables.PodCIDRFromFlag, agent)
	if err != nil {
		return nil, nil, err
	}
	if len(p.Config.PodCIDR) > 0 && p.Client.Enabled() {
		return nil, nil, fmt.Errorf("--pod-cidr=%s and --k8s-node-name=%s are exclusive: with a node name the pools are the Node's spec.podCIDRs",
			p.Config.PodCIDR[0], p.Client.NodeName)
	}
	prefixes := make([]netip.Prefix, len(pools))
	for i, r := range pools {
		prefixes[i] = r.Prefix
	}
	if err := tables.ValidatePools(prefixes); err != nil {
		return nil, nil, err
	}
	cluster, err := Parse("--cluster-cidr", p.Config.ClusterCIDR, tables.PodCIDRFromClusterCIDR, agent)
	if err != nil {
		return nil, nil, err
	}
	tbl, err := tables.NewPodCIDRTable(p.DB)
	if err != nil {
		return nil, nil, err
	}
	wtxn := p.DB.WriteTxn(tbl)
	done := tbl.RegisterInitializer(wtxn, string(tables.PodCIDRFromFlag))
	k8sDone := tables.KubernetesPodCIDRsDone(func(statedb.WriteTxn) {})
	if p.Client.Enabled() {
		k8sDone = tables.KubernetesPodCIDRsDone(tbl.RegisterInitializer(wtxn, string(tables.PodCIDRFromKubernetes)))
	}
	for _, r := range append(pools, cluster...) {
		if _, _, err := tbl.Insert(wtxn, r); err != nil {
			wtxn.Abort()
			return nil, nil, fmt.Errorf("insert pod CIDR %s: %w", r.Prefix, err)
		}
	}
	done(wtxn)
	wtxn.Commit()
	return tbl, k8sDone, nil
}
