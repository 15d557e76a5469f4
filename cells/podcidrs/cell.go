// Package podcidrs provides the pod-cidrs table, the node's pod address
// ranges that the IPAM allocates from and the datapath masquerades, and
// writes the ranges given on the command line into it:
//
//   - --pod-cidr (source "flag"): the node's pools, for a node without
//     Kubernetes (standalone, the demo);
//   - --cluster-cidr (source "cluster-cidr"): the whole cluster's pod range,
//     masqueraded but never allocated from, for a node whose pods another
//     CNI addresses.
//
// With --k8s-node-name the pools come from the Node instead (cells/k8snode
// writes source "kubernetes"), and the table is initialized only once they
// are known.
package podcidrs

import (
	"fmt"
	"net/netip"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/cells/agentconfig"
	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/cells/k8s"
	"github.com/ipmasq/ipmasq/tables"
)

// Config is the command-line configuration of the pod ranges.
type Config struct {
	// PodCIDR are the node's pools (standalone mode).
	PodCIDR []string `mapstructure:"pod-cidr"`
	// ClusterCIDR are masquerade sources that are not pools.
	ClusterCIDR []string `mapstructure:"cluster-cidr"`
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.StringSlice("pod-cidr", def.PodCIDR, "Pool of endpoint addresses and masquerade source (repeatable; IPv4 and IPv6); not with --k8s-node-name, which takes the Node's spec.podCIDRs")
	flags.StringSlice("cluster-cidr", def.ClusterCIDR, "Pod range of the whole cluster, as kube-proxy's --cluster-cidr: traffic from it is masqueraded, no address is allocated from it (repeatable)")
}

// Cell provides the pod-cidrs table, filled from the flags.
var Cell = cell.Module(
	"pod-cidrs",
	"Pod address ranges - IPAM pools and masquerade sources",

	cell.Config(Config{}),
	cell.Provide(
		newTable,
		statedb.RWTable[*tables.PodCIDR].ToTable,
	),
)

type params struct {
	cell.In

	DB     *statedb.DB
	Config Config
	Agent  agentconfig.Config
	Client *k8s.Client
}

// newTable creates the table and writes the flags' ranges. Without a node
// name the table is complete at once; with one, cells/k8snode completes it.
func newTable(p params) (statedb.RWTable[*tables.PodCIDR], KubernetesDone, error) {
	pools, err := parse("--pod-cidr", p.Config.PodCIDR, p.Agent)
	if err != nil {
		return nil, nil, err
	}
	if len(p.Config.PodCIDR) > 0 && p.Client.Enabled() {
		return nil, nil, fmt.Errorf("--pod-cidr=%s and --k8s-node-name=%s are exclusive: with a node name the pools are the Node's spec.podCIDRs",
			p.Config.PodCIDR[0], p.Client.NodeName)
	}
	if _, err := ipam.NewPools(pools); err != nil {
		return nil, nil, err
	}
	cluster, err := parse("--cluster-cidr", p.Config.ClusterCIDR, p.Agent)
	if err != nil {
		return nil, nil, err
	}
	tbl, err := tables.NewPodCIDRTable(p.DB)
	if err != nil {
		return nil, nil, err
	}
	wtxn := p.DB.WriteTxn(tbl)
	done := KubernetesDone(func(statedb.WriteTxn) {})
	if p.Client.Enabled() {
		// The Node watcher calls it once it knows the Node's ranges.
		done = KubernetesDone(tbl.RegisterInitializer(wtxn, "kubernetes"))
	}
	tables.SetPodCIDRs(wtxn, tbl, tables.PodCIDRFromFlag, pools)
	tables.SetPodCIDRs(wtxn, tbl, tables.PodCIDRFromClusterCIDR, cluster)
	wtxn.Commit()
	return tbl, done, nil
}

// KubernetesDone marks the pod-cidrs table initialized for the Node
// watcher: call it in the write transaction that first writes the Node's
// ranges (from the API server or from the copy on disk). Without
// Kubernetes it does nothing.
type KubernetesDone func(statedb.WriteTxn)

// parse reads a list of ranges; ranges of a disabled family are dropped
// (the agent does nothing for that family).
func parse(flag string, values []string, agent agentconfig.Config) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range values {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("%s %q is not a CIDR (want e.g. 10.244.1.0/24 or fd00:10:244:1::/64)", flag, s)
		}
		if m := p.Masked(); m != p {
			return nil, fmt.Errorf("%s %s has host bits set; did you mean %s?", flag, p, m)
		}
		if (p.Addr().Is4() && agent.EnableIPv4) || (p.Addr().Is6() && agent.EnableIPv6) {
			out = append(out, p)
		}
	}
	return out, nil
}
