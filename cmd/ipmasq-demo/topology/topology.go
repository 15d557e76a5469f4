// Package topology builds small networks of namespaces and veth pairs for
// end-to-end tests, benchmarks and the demo: a pod behind a node that
// masquerades its traffic to an external host (and a far host behind that
// one, on a link with a small MTU, for path MTU discovery). It touches
// nothing of the host's network: every link, address, route and sysctl it
// makes lives in namespaces it creates, and Close removes them.
package topology

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Netns is a network namespace made by this package.
type Netns struct {
	Name   string
	Handle netns.NsHandle
	NL     *netlink.Handle
}

// NewNetns creates an unnamed namespace without moving the caller.
func NewNetns(name string) (*Netns, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return nil, err
	}
	defer orig.Close()
	h, err := netns.New()
	if err != nil {
		return nil, fmt.Errorf("create netns %s: %w", name, err)
	}
	if err := netns.Set(orig); err != nil {
		panic(fmt.Sprintf("restore netns: %v", err))
	}
	nl, err := netlink.NewHandleAt(h)
	if err != nil {
		h.Close()
		return nil, err
	}
	n := &Netns{Name: name, Handle: h, NL: nl}
	if err := n.setUp("lo"); err != nil {
		n.Close()
		return nil, err
	}
	return n, nil
}

// Close releases the namespace; it goes away with its last reference.
func (n *Netns) Close() {
	n.NL.Close()
	n.Handle.Close()
}

// Do runs fn with the calling thread inside the namespace. Sockets created
// in fn belong to the namespace for their whole life.
func (n *Netns) Do(fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	if err := netns.Set(n.Handle); err != nil {
		return err
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			panic(fmt.Sprintf("restore netns: %v", err))
		}
	}()
	return fn()
}

// Sysctl writes a sysctl of the namespace, e.g. "net/ipv4/ip_forward".
func (n *Netns) Sysctl(name, value string) error {
	return n.Do(func() error {
		return os.WriteFile("/proc/sys/"+name, []byte(value), 0o644)
	})
}

func (n *Netns) setUp(name string) error {
	l, err := n.NL.LinkByName(name)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", n.Name, name, err)
	}
	return n.NL.LinkSetUp(l)
}

// Veth connects two namespaces with a veth pair named aName in a and bName
// in b, both up. aMTU sets the MTU of a's end only (0: the default); b's end
// keeps 1500.
func Veth(a *Netns, aName string, b *Netns, bName string, aMTU int) error {
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: aName},
		PeerName:      bName,
		PeerNamespace: netlink.NsFd(int(b.Handle)),
	}
	if err := a.NL.LinkAdd(veth); err != nil {
		return fmt.Errorf("veth %s/%s - %s/%s: %w", a.Name, aName, b.Name, bName, err)
	}
	if aMTU != 0 {
		l, err := a.NL.LinkByName(aName)
		if err != nil {
			return fmt.Errorf("%s: link %s: %w", a.Name, aName, err)
		}
		if err := a.NL.LinkSetMTU(l, aMTU); err != nil {
			return fmt.Errorf("%s: set MTU of %s: %w", a.Name, aName, err)
		}
	}
	if err := a.setUp(aName); err != nil {
		return err
	}
	return b.setUp(bName)
}

// SetMTU sets a device's MTU; 0 leaves it alone.
func (n *Netns) SetMTU(dev string, mtu int) error {
	if mtu == 0 {
		return nil
	}
	l, err := n.NL.LinkByName(dev)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", n.Name, dev, err)
	}
	if err := n.NL.LinkSetMTU(l, mtu); err != nil {
		return fmt.Errorf("%s: set MTU of %s: %w", n.Name, dev, err)
	}
	return nil
}

// Addr adds an address (with its prefix length) to a device, without
// duplicate address detection so IPv6 addresses are usable at once.
func (n *Netns) Addr(dev, cidr string) error {
	p, err := netip.ParsePrefix(cidr)
	if err != nil {
		return err
	}
	l, err := n.NL.LinkByName(dev)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", n.Name, dev, err)
	}
	a := &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}}
	if p.Addr().Is6() {
		a.Flags = 0x02 // IFA_F_NODAD
	}
	if err := n.NL.AddrAdd(l, a); err != nil {
		return fmt.Errorf("%s: add %s to %s: %w", n.Name, cidr, dev, err)
	}
	return nil
}

// Route adds a route to dst ("default" or a CIDR) via gw on dev.
func (n *Netns) Route(dst, gw, dev string) error {
	l, err := n.NL.LinkByName(dev)
	if err != nil {
		return err
	}
	g, err := netip.ParseAddr(gw)
	if err != nil {
		return err
	}
	r := &netlink.Route{LinkIndex: l.Attrs().Index, Gw: g.AsSlice()}
	if dst != "default" {
		p, err := netip.ParsePrefix(dst)
		if err != nil {
			return err
		}
		r.Dst = &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
	} else if g.Is6() {
		r.Dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	if err := n.NL.RouteAdd(r); err != nil {
		return fmt.Errorf("%s: route %s via %s dev %s: %w", n.Name, dst, gw, dev, err)
	}
	return nil
}

// Masquerade is the classic topology:
//
//	pod (10.244.1.2, fd00:244::2) ──pod0── node (10.244.1.1 | eth0 10.0.0.5, 2001:db8::5)
//	  ──eth0── ext (10.0.0.2, 2001:db8::2, and 203.0.113.10, 2001:db8:ff::10 on lo)
//	  ──far0 (MTU 1280)── far (198.51.100.20, 2001:db8:20::20)
//
// ext has no route to the pod CIDR (so a pod's traffic only works when it
// is masqueraded) until RouteBack adds one; far routes everything through
// ext.
type Masquerade struct {
	Pod, Node, Ext, Far *Netns
	// Client is the tunnel client, after AddTunnelClient.
	Client *Netns

	opts Options
	tuns []*Tun
}

// Options vary the Masquerade topology.
type Options struct {
	// L3Uplink makes the node–ext link (eth0 at both ends) a pair of tun
	// devices: no link-layer header, like a WireGuard, ipip or ppp uplink.
	L3Uplink bool
	// L3Client makes AddTunnelClient's link (the node's wg0) a tun pair.
	L3Client bool
	// PodMTU, when not 0, is the MTU of the node's end of the pod's veth
	// (pod0), below the uplink's 1500: the node must answer full-size
	// packets toward the pod with "fragmentation needed" / "packet too
	// big". The pod's own end keeps 1500, so it advertises a full TCP MSS
	// and path MTU discovery is what makes a bulk transfer to it work.
	PodMTU int
}

// Addresses of the Masquerade topology.
var (
	PodIP4, PodIP6       = netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("fd00:244::2")
	NodeIP4, NodeIP6     = netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("2001:db8::5")
	ExtIP4, ExtIP6       = netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("2001:db8::2")
	RemoteIP4, RemoteIP6 = netip.MustParseAddr("203.0.113.10"), netip.MustParseAddr("2001:db8:ff::10")
	FarIP4, FarIP6       = netip.MustParseAddr("198.51.100.20"), netip.MustParseAddr("2001:db8:20::20")
	PodCIDR4, PodCIDR6   = "10.244.1.0/24", "fd00:244::/64"
	// NodePodSideIP4 is the node's address on pod0: the pods' gateway,
	// the pool's first address.
	NodePodSideIP4 = netip.MustParseAddr("10.244.1.1")
	// FarMTU is the MTU of ext's link to far: smaller than the others so
	// ext must send "fragmentation needed" / "packet too big" for full-size
	// packets towards far (far itself has MTU 1500 and advertises a full MSS).
	FarMTU = 1280
)

// NewMasquerade builds the topology. Close it when done.
func NewMasquerade() (*Masquerade, error) {
	return NewMasqueradeWith(Options{})
}

// NewMasqueradeWith builds the topology with options. Close it when done.
func NewMasqueradeWith(o Options) (*Masquerade, error) {
	t := &Masquerade{opts: o}
	var err error
	for _, p := range []struct {
		n    **Netns
		name string
	}{{&t.Pod, "pod"}, {&t.Node, "node"}, {&t.Ext, "ext"}, {&t.Far, "far"}} {
		if *p.n, err = NewNetns(p.name); err != nil {
			t.Close()
			return nil, err
		}
	}
	steps := []func() error{
		func() error { return Veth(t.Pod, "eth0", t.Node, "pod0", 0) },
		func() error { return t.Node.SetMTU("pod0", o.PodMTU) },
		func() error { return t.link(t.Node, "eth0", t.Ext, "eth0", o.L3Uplink) },
		func() error { return Veth(t.Ext, "far0", t.Far, "eth0", FarMTU) },
		func() error { return t.Pod.Addr("eth0", "10.244.1.2/24") },
		func() error { return t.Pod.Addr("eth0", "fd00:244::2/64") },
		func() error { return t.Pod.Route("default", "10.244.1.1", "eth0") },
		func() error { return t.Pod.Route("default", "fd00:244::1", "eth0") },
		func() error { return t.Node.Addr("pod0", "10.244.1.1/24") },
		func() error { return t.Node.Addr("pod0", "fd00:244::1/64") },
		func() error { return t.Node.Addr("eth0", "10.0.0.5/24") },
		func() error { return t.Node.Addr("eth0", "2001:db8::5/64") },
		func() error { return t.Node.Route("default", "10.0.0.2", "eth0") },
		func() error { return t.Node.Route("default", "2001:db8::2", "eth0") },
		func() error { return t.Node.Sysctl("net/ipv4/ip_forward", "1") },
		func() error { return t.Node.Sysctl("net/ipv6/conf/all/forwarding", "1") },
		func() error { return t.Ext.Addr("eth0", "10.0.0.2/24") },
		func() error { return t.Ext.Addr("eth0", "2001:db8::2/64") },
		func() error { return t.Ext.Addr("lo", "203.0.113.10/32") },
		func() error { return t.Ext.Addr("lo", "2001:db8:ff::10/128") },
		func() error { return t.Ext.Addr("far0", "198.51.100.1/24") },
		func() error { return t.Ext.Addr("far0", "2001:db8:20::1/64") },
		func() error { return t.Ext.Sysctl("net/ipv4/ip_forward", "1") },
		func() error { return t.Ext.Sysctl("net/ipv6/conf/all/forwarding", "1") },
		func() error { return t.Far.Addr("eth0", "198.51.100.20/24") },
		func() error { return t.Far.Addr("eth0", "2001:db8:20::20/64") },
		func() error { return t.Far.Route("default", "198.51.100.1", "eth0") },
		func() error { return t.Far.Route("default", "2001:db8:20::1", "eth0") },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			t.Close()
			return nil, err
		}
	}
	return t, nil
}

// Tunnel client addresses: a client namespace behind the node's "wg0"
// (a veth, or with Options.L3Client a tun device, named like a WireGuard
// device, so rules can name it).
var (
	ClientIP4, ClientIP6         = netip.MustParseAddr("192.168.6.1"), netip.MustParseAddr("fd00:6::1")
	ClientCIDR4, ClientCIDR6     = "192.168.6.0/24", "fd00:6::/64"
	NodeTunnelIP4, NodeTunnelIP6 = "192.168.6.254", "fd00:6::fe"
)

// AddTunnelClient adds a client namespace behind a device named wg0 on the
// node: traffic from 192.168.6.1 / fd00:6::1 reaches the node over "the
// tunnel" and leaves through eth0, like VPN clients. ext has no route to
// the client prefixes.
func (t *Masquerade) AddTunnelClient() (*Netns, error) {
	c, err := NewNetns("client")
	if err != nil {
		return nil, err
	}
	steps := []func() error{
		func() error { return t.link(c, "eth0", t.Node, "wg0", t.opts.L3Client) },
		func() error { return c.Addr("eth0", "192.168.6.1/24") },
		func() error { return c.Addr("eth0", "fd00:6::1/64") },
		func() error { return c.Route("default", NodeTunnelIP4, "eth0") },
		func() error { return c.Route("default", NodeTunnelIP6, "eth0") },
		func() error { return t.Node.Addr("wg0", NodeTunnelIP4+"/24") },
		func() error { return t.Node.Addr("wg0", NodeTunnelIP6+"/64") },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			c.Close()
			return nil, err
		}
	}
	t.Client = c
	return c, nil
}

// link connects two namespaces with a veth pair, or a tun pair when l3.
func (t *Masquerade) link(a *Netns, aName string, b *Netns, bName string, l3 bool) error {
	if !l3 {
		return Veth(a, aName, b, bName, 0)
	}
	tun, err := TunLink(a, aName, b, bName)
	if err != nil {
		return err
	}
	t.tuns = append(t.tuns, tun)
	return nil
}

// RouteBack gives ext a route to the pod CIDRs through the node, so traffic
// that is not masqueraded gets its replies too.
func (t *Masquerade) RouteBack() error {
	if err := t.Ext.Route(PodCIDR4, "10.0.0.5", "eth0"); err != nil {
		return err
	}
	return t.Ext.Route(PodCIDR6, "2001:db8::5", "eth0")
}

// Start starts cmd inside the namespace: a child inherits the namespace of
// the thread that forks it.
func (n *Netns) Start(cmd *exec.Cmd) error {
	return n.Do(cmd.Start)
}

// Close removes every namespace (and with them links, routes and sysctls).
func (t *Masquerade) Close() error {
	var errs []error
	for _, tun := range t.tuns {
		errs = append(errs, tun.Close())
	}
	for _, n := range []*Netns{t.Pod, t.Node, t.Ext, t.Far, t.Client} {
		if n != nil {
			n.Close()
		}
	}
	return errors.Join(errs...)
}
