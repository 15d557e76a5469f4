package e2e

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// TestCNIPtp: the upstream ptp plugin with ipmasq-cni as its IPAM, driven
// through libcni like a container runtime on the node. The endpoint gets
// its address from the agent, the agent derives its ip rules, its traffic
// is masqueraded, and DEL undoes all of it.
func TestCNIPtp(t *testing.T) {
	privtest.Require(t)
	pluginDir := buildCNIPlugins(t)
	node, ext := cniTopology(t)
	startServers(t, ext, topology.RemoteIP4, topology.RemoteIP6)
	a := newAgent(t, node, "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\nmasqLinkLocal: false\n")
	a.args = []string{"--egress-route-table=0"}
	a.start()
	socket := filepath.Join(a.dir, "api.sock")
	ctr := containerNetns(t)

	// As a runtime on the node would: libcni and the plugins it runs are
	// in the node namespace, so ptp's host side lands there.
	list, err := libcni.ConfListFromBytes([]byte(fmt.Sprintf(`{
		"cniVersion": "1.1.0",
		"name": "pods",
		"plugins": [{
			"type": "ptp",
			"ipam": {
				"type": "ipmasq-cni", "socketPath": %q,
				"routeTable": 11, "ipv6": true
			}
		}]
	}`, socket)))
	if err != nil {
		t.Fatal(err)
	}
	cni := libcni.NewCNIConfigWithCacheDir([]string{pluginDir}, t.TempDir(), nil)
	rt := &libcni.RuntimeConf{ContainerID: "c0ffee", NetNS: ctr.path, IfName: "eth0"}
	onNode := func(fn func(ctx context.Context) error) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return node.Do(func() error { return fn(ctx) })
	}
	added := false
	t.Cleanup(func() {
		if added {
			onNode(func(ctx context.Context) error { return cni.DelNetworkList(ctx, list, rt) })
		}
	})

	// 1. STATUS: the agent answers.
	if err := onNode(func(ctx context.Context) error { return cni.GetStatusNetworkList(ctx, list) }); err != nil {
		t.Fatalf("STATUS: %v", err)
	}

	// 2. ADD: the result, the agent's list and the container agree.
	var res types.Result
	err = onNode(func(ctx context.Context) (err error) {
		res, err = cni.AddNetworkList(ctx, list, rt)
		return err
	})
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	added = true
	result, err := types100.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	allocs := allocationsOf(t, socket, "c0ffee/eth0")
	if len(allocs) != 2 {
		t.Fatalf("agent holds %v for c0ffee/eth0, want an IPv4 and an IPv6 address", allocs)
	}
	var ip4, ip6 netip.Addr
	for _, al := range allocs {
		if al.IP.Is4() {
			ip4 = al.IP
		} else {
			ip6 = al.IP
		}
		if al.RouteTable != 11 {
			t.Errorf("%s has route table %d, want 11 from the ipam config", al.IP, al.RouteTable)
		}
		if !slices.ContainsFunc(result.IPs, func(c *types100.IPConfig) bool { return c.Address.IP.Equal(al.IP.AsSlice()) }) {
			t.Errorf("ADD result %v lacks %s", result.IPs, al.IP)
		}
	}
	if !ip4.IsValid() || !ip6.IsValid() || !netip.MustParsePrefix(topology.PodCIDR4).Contains(ip4) {
		t.Fatalf("allocations %v, want one of each family from the pod CIDRs", allocs)
	}
	if got := ctr.addrs(t); !slices.Contains(got, ip4.String()) || !slices.Contains(got, ip6.String()) {
		t.Fatalf("container eth0 has %v, want %s and %s", got, ip4, ip6)
	}
	if got := nodeVeths(t, node); len(got) != 1 {
		t.Fatalf("node has veths %v, want ptp's host side", got)
	}

	// 3. The agent's ip rules for the endpoint, one per no-masquerade CIDR.
	var want strings.Builder
	for _, al := range allocs {
		for _, c := range al.NonMasqueradeCIDRs {
			fmt.Fprintf(&want, "111: from %s to %s lookup 11\n", al.IP, c)
		}
	}
	a.waitFor("the endpoint's ip rules", func() bool { return endpointRules(t, node, ip4, ip6) == sortedRules(want.String()) })
	if !strings.Contains(want.String(), "from "+ip4.String()+" to 10.0.0.0/8 lookup 11") {
		t.Fatalf("expected rules lack the config's 10.0.0.0/8:\n%s", want.String())
	}

	// 4. CHECK through ptp and the IPAM.
	if err := onNode(func(ctx context.Context) error { return cni.CheckNetworkList(ctx, list, rt) }); err != nil {
		t.Fatalf("CHECK: %v", err)
	}

	// 5. Traffic from the container is masqueraded (ext has no route back
	// to the pod CIDRs, so only masqueraded flows get answers).
	for dst, want := range map[netip.Addr]netip.Addr{topology.RemoteIP4: topology.NodeIP4, topology.RemoteIP6: topology.NodeIP6} {
		var seen string
		var err error
		// IPv6: the gateway fe80::1 on the host side may still be tentative.
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if seen, err = tcpSource(ctr.ns, dst); err == nil {
				break
			}
		}
		if err != nil || seen != want.String() {
			t.Fatalf("TCP from the container to %s: server saw %q (%v), want %s", dst, seen, err, want)
		}
	}

	// 6. DEL: the endpoint, its rules and the interface go; DEL again is fine.
	if err := onNode(func(ctx context.Context) error { return cni.DelNetworkList(ctx, list, rt) }); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	added = false
	if got := allocationsOf(t, socket, "c0ffee/eth0"); len(got) != 0 {
		t.Fatalf("agent still holds %v after DEL", got)
	}
	a.waitFor("the endpoint's ip rules to go", func() bool { return endpointRules(t, node, ip4, ip6) == "" })
	if got := ctr.addrs(t); len(got) != 0 {
		t.Fatalf("container still has %v after DEL", got)
	}
	if got := nodeVeths(t, node); len(got) != 0 {
		t.Fatalf("node still has ptp's %v after DEL", got)
	}
	if err := onNode(func(ctx context.Context) error { return cni.DelNetworkList(ctx, list, rt) }); err != nil {
		t.Fatalf("second DEL: %v", err)
	}

	// 7. The agent stopped: ADD fails saying which socket, "try again later",
	// and STATUS fails.
	a.stop(syscall.SIGTERM)
	rt2 := &libcni.RuntimeConf{ContainerID: "dead", NetNS: ctr.path, IfName: "eth0"}
	err = onNode(func(ctx context.Context) error {
		_, err := cni.AddNetworkList(ctx, list, rt2)
		return err
	})
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code != types.ErrTryAgainLater || !strings.Contains(cniErr.Msg, socket) {
		t.Fatalf("ADD with the agent stopped: %v, want error 11 naming %s", err, socket)
	}
	t.Logf("ADD with the agent stopped: %v", err)
	if err := onNode(func(ctx context.Context) error { return cni.GetStatusNetworkList(ctx, list) }); err == nil {
		t.Fatal("STATUS with the agent stopped succeeded")
	}
	// ptp's half-made interface does not stay behind.
	if got := ctr.addrs(t); len(got) != 0 {
		t.Fatalf("container has %v after the failed ADD", got)
	}
}

// buildCNIPlugins builds ipmasq-cni and the upstream ptp plugin (the
// version in go.mod) into a directory used as CNI_PATH.
func buildCNIPlugins(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for name, pkg := range map[string]string{
		"ipmasq-cni": "github.com/ipmasq/ipmasq/cmd/ipmasq-cni",
		"ptp":        "github.com/containernetworking/plugins/plugins/main/ptp",
	} {
		out, err := exec.Command("go", "build", "-o", filepath.Join(dir, name), pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("build %s: %v\n%s", pkg, err, out)
		}
	}
	return dir
}

// cniTopology is a node (eth0 10.0.0.5, 2001:db8::5) behind ext (10.0.0.2,
// 2001:db8::2, and 203.0.113.10, 2001:db8:ff::10 on lo). ext has no route
// to the pod CIDRs. The node has no pod address of its own: every endpoint
// comes from the agent.
func cniTopology(t *testing.T) (node, ext *topology.Netns) {
	t.Helper()
	var err error
	if node, err = topology.NewNetns("node"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(node.Close)
	if ext, err = topology.NewNetns("ext"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ext.Close)
	for _, step := range []func() error{
		func() error { return topology.Veth(node, "eth0", ext, "eth0", 0) },
		func() error { return node.Addr("eth0", "10.0.0.5/24") },
		func() error { return node.Addr("eth0", "2001:db8::5/64") },
		func() error { return node.Route("default", "10.0.0.2", "eth0") },
		func() error { return node.Route("default", "2001:db8::2", "eth0") },
		func() error { return ext.Addr("eth0", "10.0.0.2/24") },
		func() error { return ext.Addr("eth0", "2001:db8::2/64") },
		func() error { return ext.Addr("lo", "203.0.113.10/32") },
		func() error { return ext.Addr("lo", "2001:db8:ff::10/128") },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	return node, ext
}

// cniContainer is a network namespace with a path, as runtimes hand to
// CNI plugins (a path, not a file descriptor): the namespace bound onto a
// file of the test's own directory, not a name in the machine's
// /run/netns.
type cniContainer struct {
	path string
	ns   *topology.Netns
}

func containerNetns(t *testing.T) *cniContainer {
	t.Helper()
	h, nl := privtest.NewNetns(t)
	path := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", int(h)), path, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind the container's netns onto %s: %v", path, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			t.Errorf("unbind %s: %v", path, err)
		}
	})
	return &cniContainer{path: path, ns: &topology.Netns{Name: "container", Handle: h, NL: nl}}
}

// addrs lists the global addresses on the container's eth0 (none when
// eth0 does not exist).
func (c *cniContainer) addrs(t *testing.T) []string {
	t.Helper()
	l, err := c.ns.NL.LinkByName("eth0")
	if err != nil {
		return nil
	}
	as, err := c.ns.NL.AddrList(l, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, a := range as {
		if a.IP.IsGlobalUnicast() {
			out = append(out, a.IP.String())
		}
	}
	return out
}

// nodeVeths lists the veths of the node other than its uplink.
func nodeVeths(t *testing.T, node *topology.Netns) []string {
	t.Helper()
	links, err := node.NL.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range links {
		if l.Type() == "veth" && l.Attrs().Name != "eth0" {
			out = append(out, l.Attrs().Name)
		}
	}
	return out
}

func allocationsOf(t *testing.T, socket, owner string) []ipamapi.AllocationResponse {
	t.Helper()
	all, err := ipamapi.NewClient(socket).List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []ipamapi.AllocationResponse
	for _, a := range all {
		if a.Owner == owner {
			out = append(out, a)
		}
	}
	return out
}

// endpointRules lists the node's ip rules from the endpoint's addresses,
// like `ip rule`, sorted.
func endpointRules(t *testing.T, node *topology.Netns, ips ...netip.Addr) string {
	t.Helper()
	keys, err := iprules.NewNetlinkTarget(node.NL).List()
	if err != nil {
		t.Fatal(err)
	}
	keys = slices.DeleteFunc(keys, func(k tables.IPRuleKey) bool {
		return !k.From.IsSingleIP() || !slices.Contains(ips, k.From.Addr())
	})
	return sortedRules(iprules.Format(keys))
}

func sortedRules(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	slices.Sort(lines)
	if len(lines) == 1 && lines[0] == "" {
		return ""
	}
	return strings.Join(lines, "\n") + "\n"
}
