package topology

import (
	"errors"
	"fmt"
	"net/netip"
)

// Cluster is a multi-node topology: nodes, each with one pod, behind a
// router that is also the external host, and optionally a namespace
// holding the Kubernetes API server:
//
//	pod<i> (10.244.<i>.x) ──eth0/pod0── node<i> (eth0 10.0.<i>.5)
//	  ──eth0/n<i>── ext (10.0.<i>.1; 203.0.113.10 on lo) ──kapi── api (10.98.0.2, API on 10.99.0.1)
//
// ext routes each node's pod CIDR to that node, as an underlay with pod
// routes does, so pod-to-pod traffic between nodes keeps its addresses;
// whether pod traffic to ext itself is masqueraded shows in the source
// address ext's servers see.
type Cluster struct {
	Ext   *Netns
	Nodes []*ClusterNode
}

// ClusterNode is one node of a Cluster and its pod.
type ClusterNode struct {
	Name string
	Node *Netns
	Pod  *Netns
	// IP4 is the node's address on its uplink eth0.
	IP4 netip.Addr
	// PodCIDR4 is the node's pod range; its first address is the gateway
	// on pod0.
	PodCIDR4 netip.Prefix
}

// ClusterRemoteIP4 is the external address on ext's loopback.
var ClusterRemoteIP4 = netip.MustParseAddr("203.0.113.10")

// NewCluster builds n nodes (node1 ... node<n>, pod CIDR 10.244.<i>.0/24).
// The pods have no address yet: AddPodAddr gives them the one IPAM hands
// out.
func NewCluster(n int) (*Cluster, error) {
	c := &Cluster{}
	var err error
	if c.Ext, err = NewNetns("ext"); err != nil {
		return nil, err
	}
	steps := []func() error{
		func() error { return c.Ext.Addr("lo", ClusterRemoteIP4.String()+"/32") },
		func() error { return c.Ext.Sysctl("net/ipv4/ip_forward", "1") },
	}
	for i := 1; i <= n; i++ {
		cn := &ClusterNode{
			Name:     fmt.Sprintf("node%d", i),
			IP4:      netip.AddrFrom4([4]byte{10, 0, byte(i), 5}),
			PodCIDR4: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 244, byte(i), 0}), 24),
		}
		c.Nodes = append(c.Nodes, cn)
		if cn.Node, err = NewNetns(cn.Name); err != nil {
			c.Close()
			return nil, err
		}
		if cn.Pod, err = NewNetns(fmt.Sprintf("pod%d", i)); err != nil {
			c.Close()
			return nil, err
		}
		extIP := fmt.Sprintf("10.0.%d.1", i)
		gw := cn.PodCIDR4.Addr().Next()
		uplink := fmt.Sprintf("n%d", i)
		steps = append(steps,
			func() error { return Veth(cn.Node, "eth0", c.Ext, uplink, 0) },
			func() error { return Veth(cn.Pod, "eth0", cn.Node, "pod0", 0) },
			func() error { return cn.Node.Addr("eth0", cn.IP4.String()+"/24") },
			func() error { return cn.Node.Addr("pod0", fmt.Sprintf("%s/%d", gw, cn.PodCIDR4.Bits())) },
			func() error { return cn.Node.Route("default", extIP, "eth0") },
			func() error { return cn.Node.Sysctl("net/ipv4/ip_forward", "1") },
			func() error { return c.Ext.Addr(uplink, extIP+"/24") },
			func() error { return c.Ext.Route(cn.PodCIDR4.String(), cn.IP4.String(), uplink) },
		)
	}
	for _, step := range steps {
		if err := step(); err != nil {
			c.Close()
			return nil, err
		}
	}
	return c, nil
}

// AddPodAddr gives node i's pod the address ip (from the node's pool),
// with its gateway as the default route.
func (c *Cluster) AddPodAddr(cn *ClusterNode, ip netip.Addr) error {
	if !cn.PodCIDR4.Contains(ip) {
		return fmt.Errorf("%s: %s is not in the pod CIDR %s", cn.Name, ip, cn.PodCIDR4)
	}
	if err := cn.Pod.Addr("eth0", fmt.Sprintf("%s/%d", ip, cn.PodCIDR4.Bits())); err != nil {
		return err
	}
	return cn.Pod.Route("default", cn.PodCIDR4.Addr().Next().String(), "eth0")
}

// ConnectAPI links the API server's namespace api (whose server listens on
// apiAddr, an address on its loopback) to ext, so every node reaches it
// through its default route.
func (c *Cluster) ConnectAPI(api *Netns, apiAddr netip.Addr) error {
	steps := []func() error{
		func() error { return Veth(api, "eth0", c.Ext, "kapi", 0) },
		func() error { return api.Addr("eth0", "10.98.0.2/24") },
		func() error { return c.Ext.Addr("kapi", "10.98.0.1/24") },
		func() error { return api.Route("default", "10.98.0.1", "eth0") },
		func() error { return c.Ext.Route(apiAddr.String()+"/32", "10.98.0.2", "kapi") },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return err
		}
	}
	return nil
}

// Close removes the namespaces (the API server's is its owner's).
func (c *Cluster) Close() error {
	var errs []error
	for _, cn := range c.Nodes {
		for _, n := range []*Netns{cn.Pod, cn.Node} {
			if n != nil {
				n.Close()
			}
		}
	}
	if c.Ext != nil {
		c.Ext.Close()
	}
	return errors.Join(errs...)
}
