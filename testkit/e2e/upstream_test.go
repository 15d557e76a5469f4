package e2e

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"sigs.k8s.io/yaml"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// The differential test against the Kubernetes ip-masq-agent
// (kubernetes-sigs/ip-masq-agent). Its module is not served here, so the
// reference is the chain it writes, rebuilt from its source
// (cmd/ip-masq-agent/ip-masq-agent.go, read for facts only):
//
//   - config: defaults RFC 1918 (10/8, 172.16/12, 192.168/16), or the 11
//     reserved ranges with --nomasq-all-reserved-ranges; the file is
//     YAML→JSON decoded over those defaults, so the defaults stay only when
//     the key nonMasqueradeCIDRs is absent (an empty list or null empties
//     them); masqLinkLocal/masqLinkLocalIPv6 default false; cidrLimit 64;
//   - validation: every CIDR must parse and have no host bits; an IPv6 CIDR
//     without --enable-ipv6 fails it; a failed first sync installs no rule;
//   - rules (iptables-restore into table nat): chain IP-MASQ-AGENT, jumped to
//     from POSTROUTING by "-m addrtype ! --dst-type LOCAL" (no source match);
//     "-d 169.254.0.0/16 -j RETURN" unless masqLinkLocal; "-d <cidr> -j
//     RETURN" per IPv4 CIDR in file order; with --to-ports one MASQUERADE
//     --to-ports rule per protocol (tcp, udp, sctp) per range; then "-j
//     MASQUERADE" (both with --random-fully unless --random-fully=false);
//   - IPv6 only with --enable-ipv6: the same chain in ip6tables with
//     fe80::/10 (unless masqLinkLocalIPv6) and the IPv6 CIDRs.
//
// Both masquerade every forwarded source (upstream has no source match,
// ipmasq's default is every source but the node's own addresses), so the
// probes are sent from two sources of the pod: its address in the pod CIDR
// and one outside every configured CIDR (as Calico blocks or ENI secondary
// addresses are). Deliberate differences, excluded here and documented in
// docs/migrate.md: ipmasq-only keys (masqueradeCIDRs exceptions,
// masqueradeRules) are not in the corpus; upstream's cidrLimit default of 64
// (ipmasq takes up to --max-nonmasq-cidrs) is not exercised.

// upstreamCase is one config and argument set, run under both.
type upstreamCase struct {
	name string
	// file is the config file's content; nil: no file.
	file *string
	// args are the agent's args, given to both (upstream's flags).
	args []string
}

func file(s string) *string { return &s }

var upstreamCorpus = []upstreamCase{
	{"no file", nil, nil},
	{"no file, all reserved ranges", nil, []string{"--nomasq-all-reserved-ranges"}},
	{"zero bytes", file(""), nil},
	{"no key", file("masqLinkLocal: false\nresyncInterval: 60s\n"), nil},
	{"no key, all reserved ranges", file("resyncInterval: 60s\n"), []string{"--nomasq-all-reserved-ranges=true"}},
	{"empty list", file("nonMasqueradeCIDRs: []\n"), nil},
	{"empty list, all reserved ranges", file("nonMasqueradeCIDRs: []\n"), []string{"--nomasq-all-reserved-ranges"}},
	{"null list", file("nonMasqueradeCIDRs:\nmasqLinkLocal: true\n"), nil},
	{"upstream's agent-config", file("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 172.16.0.0/12\n  - 192.168.0.0/16\ncidrLimit: 64\nmasqLinkLocal: false\nmasqLinkLocalIPv6: false\nresyncInterval: 60s\n"), nil},
	{"masqLinkLocal", file("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n"), nil},
	{"nested and odd ranges, JSON", file(`{"nonMasqueradeCIDRs": ["100.64.0.0/10", "100.64.1.0/24", "198.18.0.0/15", "240.0.0.0/4", "1.2.3.4/32", "128.0.0.0/2"]}`), nil},
	{"upstream DaemonSet args", file("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n"),
		// Go's flag package takes one dash too: -v=2.
		[]string{"--masq-chain=IP-MASQ", "-v=2", "--logtostderr", "--random-fully=false", "--to-ports=40000-40100"}},
	{"IPv6", file("nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8, 2001:db8::/32]\n"), []string{"--enable-ipv6"}},
	{"IPv6, masqLinkLocalIPv6", file("nonMasqueradeCIDRs: [2001:db8:1::/48, 172.16.0.0/12]\nmasqLinkLocalIPv6: true\n"), []string{"--enable-ipv6=true"}},
	{"IPv6 defaults", nil, []string{"--enable-ipv6"}},
	{"IPv6 CIDR without --enable-ipv6", file("nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n"), nil},
	// Upstream's help example: several ranges, one MASQUERADE rule each.
	{"--to-ports with several ranges", file("nonMasqueradeCIDRs: [10.0.0.0/8]\n"),
		[]string{"--to-ports=40000-40009,50000-50019", "--random-fully=false"}},
	// Upstream ignores a key it does not know; so does ipmasq, warning.
	{"unknown key", file("nonMasqueradeCIDRs: [10.0.0.0/8, 100.64.0.0/10]\nresyncIntervall: 60s\nmasqLinkLocal: true\n"), nil},
}

// upstreamConfig is upstream's MasqConfig as its syncConfig leaves it.
type upstreamConfig struct {
	NonMasqueradeCIDRs []string `json:"nonMasqueradeCIDRs"`
	CidrLimit          int      `json:"cidrLimit"`
	MasqLinkLocal      bool     `json:"masqLinkLocal"`
	MasqLinkLocalIPv6  bool     `json:"masqLinkLocalIPv6"`
}

type upstreamArgs struct {
	allReserved, ipv6, randomFully bool
	toPorts                        string
}

func parseUpstreamArgs(args []string) upstreamArgs {
	a := upstreamArgs{randomFully: true}
	for _, arg := range args {
		name, value, _ := strings.Cut(strings.TrimLeft(arg, "-"), "=")
		on := value == "" || value == "true"
		switch name {
		case "nomasq-all-reserved-ranges":
			a.allReserved = on
		case "enable-ipv6":
			a.ipv6 = on
		case "random-fully":
			a.randomFully = on
		case "to-ports":
			a.toPorts = value
		}
	}
	return a
}

// upstreamRules returns the iptables (v6: ip6tables) commands upstream's
// first sync leaves in table nat, or nil when that sync fails (no rules).
func upstreamRules(c upstreamCase, v6 bool) [][]string {
	a := parseUpstreamArgs(c.args)
	cfg := upstreamConfig{NonMasqueradeCIDRs: []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"}, CidrLimit: 64}
	if a.allReserved {
		cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs, "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24",
			"192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4")
	}
	if c.file != nil {
		j, err := yaml.YAMLToJSON([]byte(*c.file))
		if err != nil || json.Unmarshal(j, &cfg) != nil {
			return nil
		}
	}
	if len(cfg.NonMasqueradeCIDRs) > cfg.CidrLimit {
		return nil
	}
	for _, s := range cfg.NonMasqueradeCIDRs {
		p, err := netip.ParsePrefix(s)
		if err != nil || p.Masked() != p || (p.Addr().Is6() && !a.ipv6) {
			return nil
		}
	}
	if v6 && !a.ipv6 {
		return nil
	}
	chain := "IP-MASQ-AGENT"
	rules := [][]string{
		{"-t", "nat", "-N", chain},
		{"-t", "nat", "-A", "POSTROUTING", "-m", "addrtype", "!", "--dst-type", "LOCAL", "-j", chain},
	}
	ret := func(cidr string) {
		rules = append(rules, []string{"-t", "nat", "-A", chain, "-d", cidr, "-j", "RETURN"})
	}
	if !v6 && !cfg.MasqLinkLocal {
		ret("169.254.0.0/16")
	}
	if v6 && !cfg.MasqLinkLocalIPv6 {
		ret("fe80::/10")
	}
	for _, s := range cfg.NonMasqueradeCIDRs {
		if netip.MustParsePrefix(s).Addr().Is6() == v6 {
			ret(s)
		}
	}
	masq := []string{"-t", "nat", "-A", chain, "-j", "MASQUERADE"}
	if a.randomFully {
		masq = append(masq, "--random-fully")
	}
	if a.toPorts != "" {
		// writeMasqToPortsRules: a rule per range, each but the last
		// taking what is left with the probability of its share.
		ranges := strings.Split(a.toPorts, ",")
		sizes := make([]int, len(ranges))
		left := 0
		for i, r := range ranges {
			lo, hi, ok := strings.Cut(r, "-")
			if !ok {
				hi = lo
			}
			n1, _ := strconv.Atoi(lo)
			n2, _ := strconv.Atoi(hi)
			sizes[i] = n2 - n1 + 1
			left += sizes[i]
		}
		for _, proto := range []string{"tcp", "udp", "sctp"} {
			size := left
			for i, r := range ranges {
				rule := append(slices.Clone(masq), "-p", proto)
				if sizes[i] != size {
					rule = append(rule, "-m", "statistic", "--mode", "random", "--probability",
						strconv.FormatFloat(float64(sizes[i])/float64(size), 'f', -1, 64))
				}
				size -= sizes[i]
				rules = append(rules, append(rule, "--to-ports", r))
			}
		}
	}
	return append(rules, masq)
}

// inToPorts reports whether port is in one of the ranges of --to-ports.
func inToPorts(t *testing.T, toPorts string, port uint16) (int, bool) {
	t.Helper()
	for i, r := range strings.Split(toPorts, ",") {
		lo, hi, ok := strings.Cut(r, "-")
		if !ok {
			hi = lo
		}
		if min, max := mustAtoi(t, lo), mustAtoi(t, hi); int(port) >= min && int(port) <= max {
			return i, true
		}
	}
	return -1, false
}

// Addresses of the differential topology:
//
//	pod (10.244.1.2, fd00:244::2; 10.200.7.66, fd00:200::66) ──pod0── node (10.244.1.1, fd00:244::1 | eth0 11.11.11.1, 2a01:ffff::1)
//	  ──eth0── remote (11.11.11.2, 2a01:ffff::2)
//
// The pod's second pair of addresses is outside every CIDR the agent is
// given (--pod-cidr names 10.244.1.0/24 and fd00:244::/64 only).
// Every probe leaves the node towards remote (default route), which records
// what arrives on its link with a packet socket, whatever the destination.
var (
	diffNode4, diffRemote4 = netip.MustParseAddr("11.11.11.1"), netip.MustParseAddr("11.11.11.2")
	diffNode6, diffRemote6 = netip.MustParseAddr("2a01:ffff::1"), netip.MustParseAddr("2a01:ffff::2")
	// diffPodSources are the pod's sources: in the pod CIDR, and outside
	// every configured CIDR.
	diffPodSources = []podSource{
		{"pod CIDR", netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("fd00:244::2")},
		{"outside every configured CIDR", netip.MustParseAddr("10.200.7.66"), netip.MustParseAddr("fd00:200::66")},
	}
)

// podSource is a pair of the pod's addresses the probes are sent from.
type podSource struct {
	name   string
	v4, v6 netip.Addr
}

type diffTopology struct{ pod, node, remote *topology.Netns }

func newDiffTopology(t *testing.T) *diffTopology {
	t.Helper()
	var d diffTopology
	for _, n := range []struct {
		p    **topology.Netns
		name string
	}{{&d.pod, "pod"}, {&d.node, "node"}, {&d.remote, "remote"}} {
		ns, err := topology.NewNetns(n.name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ns.Close)
		*n.p = ns
	}
	for _, step := range []func() error{
		func() error { return topology.Veth(d.pod, "eth0", d.node, "pod0", 0) },
		func() error { return topology.Veth(d.node, "eth0", d.remote, "eth0", 0) },
		func() error { return d.pod.Addr("eth0", "10.244.1.2/24") },
		func() error { return d.pod.Addr("eth0", "fd00:244::2/64") },
		func() error { return d.pod.Addr("eth0", "10.200.7.66/32") },
		func() error { return d.pod.Addr("eth0", "fd00:200::66/128") },
		func() error { return d.pod.Route("default", "10.244.1.1", "eth0") },
		func() error { return d.pod.Route("default", "fd00:244::1", "eth0") },
		func() error { return d.node.Addr("pod0", "10.244.1.1/24") },
		func() error { return d.node.Addr("pod0", "fd00:244::1/64") },
		func() error { return d.node.Route("10.200.7.66/32", "10.244.1.2", "pod0") },
		func() error { return d.node.Route("fd00:200::66/128", "fd00:244::2", "pod0") },
		func() error { return d.node.Addr("eth0", diffNode4.String()+"/30") },
		func() error { return d.node.Addr("eth0", diffNode6.String()+"/64") },
		func() error { return d.node.Route("default", diffRemote4.String(), "eth0") },
		func() error { return d.node.Route("default", diffRemote6.String(), "eth0") },
		func() error { return d.remote.Addr("eth0", diffRemote4.String()+"/30") },
		func() error { return d.remote.Addr("eth0", diffRemote6.String()+"/64") },
		func() error { return d.node.Sysctl("net/ipv4/ip_forward", "1") },
		func() error { return d.node.Sysctl("net/ipv6/conf/all/forwarding", "1") },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	return &d
}

// outcome of one probe as remote saw it.
type outcome struct {
	seen bool
	src  netip.Addr
	port uint16
}

func (o outcome) String() string {
	if !o.seen {
		return "not delivered"
	}
	return fmt.Sprintf("from %s:%d", o.src, o.port)
}

// masqueraded tells the decision: the node's address as source.
func (o outcome) decision() string {
	switch {
	case !o.seen:
		return "not delivered"
	case o.src == diffNode4 || o.src == diffNode6:
		return "masqueraded"
	}
	return "not masqueraded (" + o.src.String() + ")"
}

// probe sends one UDP datagram from the pod's source src to each
// destination, to UDP port dport, and returns what remote saw of each. Destinations that did not
// arrive are sent again (twice), so a dropped packet is not read as a
// decision.
func (d *diffTopology) probe(t *testing.T, dport uint16, src podSource, dsts []netip.Addr) map[netip.Addr]outcome {
	t.Helper()
	var fd int
	if err := d.remote.Do(func() error {
		var err error
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		l, err := d.remote.NL.LinkByName("eth0")
		if err != nil {
			return err
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 16<<20); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: l.Attrs().Index})
	}); err != nil {
		t.Fatalf("packet socket on remote: %v", err)
	}
	defer unix.Close(fd)

	var c4, c6 *net.UDPConn
	if err := d.pod.Do(func() error {
		var err error
		if c4, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(src.v4, 0))); err != nil {
			return err
		}
		c6, err = net.ListenUDP("udp6", net.UDPAddrFromAddrPort(netip.AddrPortFrom(src.v6, 0)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c4.Close()
	defer c6.Close()

	got := map[netip.Addr]outcome{}
	read := func(quiet time.Duration) {
		buf := make([]byte, 2048)
		tv := unix.NsecToTimeval(quiet.Nanoseconds())
		unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		for {
			n, _, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				return // quiet for that long
			}
			if dst, o, ok := parseProbe(buf[:n], dport); ok {
				got[dst] = o
			}
		}
	}
	// Resolve the neighbours of both hops (pod → node, node → remote) for
	// both families first: packets queued behind an unresolved neighbour
	// are dropped past a few, and an IPv6 resolution can take a second.
	warm := []netip.Addr{diffRemote4, diffRemote6}
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, ok4 := got[diffRemote4]; ok4 {
			if _, ok6 := got[diffRemote6]; ok6 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("probes to remote's own addresses %v never arrived", warm)
		}
		c4.WriteToUDPAddrPort([]byte("warm"), netip.AddrPortFrom(diffRemote4, dport))
		c6.WriteToUDPAddrPort([]byte("warm"), netip.AddrPortFrom(diffRemote6, dport))
		read(50 * time.Millisecond)
	}
	for pass := 0; pass < 3; pass++ {
		sent := 0
		for _, dst := range dsts {
			if _, ok := got[dst]; ok {
				continue
			}
			c := c4
			if dst.Is6() {
				c = c6
			}
			c.WriteToUDPAddrPort([]byte("probe"), netip.AddrPortFrom(dst, dport)) // unroutable ones fail: not delivered
			if sent++; sent%200 == 0 {
				read(time.Millisecond) // let the veth backlogs drain
			}
		}
		read(300 * time.Millisecond)
	}
	return got
}

func mustAtoi(t *testing.T, s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// parseProbe reads an IPv4 or IPv6 UDP packet to dport.
func parseProbe(p []byte, dport uint16) (netip.Addr, outcome, bool) {
	if len(p) < 1 {
		return netip.Addr{}, outcome{}, false
	}
	var src, dst netip.Addr
	var udp []byte
	switch p[0] >> 4 {
	case 4:
		ihl := int(p[0]&0x0f) * 4
		if len(p) < ihl+8 || p[9] != unix.IPPROTO_UDP {
			return netip.Addr{}, outcome{}, false
		}
		src, dst, udp = netip.AddrFrom4([4]byte(p[12:16])), netip.AddrFrom4([4]byte(p[16:20])), p[ihl:]
	case 6:
		if len(p) < 48 || p[6] != unix.IPPROTO_UDP {
			return netip.Addr{}, outcome{}, false
		}
		src, dst, udp = netip.AddrFrom16([16]byte(p[8:24])), netip.AddrFrom16([16]byte(p[24:40])), p[40:]
	default:
		return netip.Addr{}, outcome{}, false
	}
	if binary.BigEndian.Uint16(udp[2:4]) != dport {
		return netip.Addr{}, outcome{}, false
	}
	return dst, outcome{seen: true, src: src, port: binary.BigEndian.Uint16(udp[0:2])}, true
}

// destinations: the edges of every range either side may decide on (first
// and last address, and the ones just outside), addresses inside each, and
// random ones (seeded, the seed logged), IPv4 and IPv6.
func destinations(t *testing.T) []netip.Addr {
	ranges := []string{
		"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24",
		"192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4", "169.254.0.0/16",
		"100.64.1.0/24", "1.2.3.4/32", "128.0.0.0/2",
		"fd00::/8", "2001:db8::/32", "2001:db8:1::/48", "fe80::/10", "2000::/3",
	}
	set := map[netip.Addr]bool{}
	for _, r := range ranges {
		p := netip.MustParsePrefix(r)
		first, last := p.Addr(), lastAddr(p)
		for _, a := range []netip.Addr{first, first.Next(), last.Prev(), last, first.Prev(), last.Next()} {
			if a.IsValid() {
				set[a] = true
			}
		}
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("random destinations: seed %d", seed)
	rnd := rand.New(rand.NewPCG(seed, 0))
	for len(set) < 2500 {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], rnd.Uint32())
		set[netip.AddrFrom4(b)] = true
	}
	for i := 0; i < 600; i++ {
		var b [16]byte
		binary.BigEndian.PutUint64(b[:8], rnd.Uint64())
		binary.BigEndian.PutUint64(b[8:], rnd.Uint64())
		switch i % 3 { // mostly where the corpus's IPv6 ranges are
		case 0:
			b[0] = 0xfd
		case 1:
			b[0], b[1], b[2], b[3] = 0x20, 0x01, 0x0d, 0xb8
			if i%2 == 0 {
				b[4], b[5] = 0, 1
			}
		}
		set[netip.AddrFrom16(b)] = true
	}
	out := make([]netip.Addr, 0, len(set))
	for a := range set {
		// Skip the topology's own links: on-link, never through the node's uplink.
		if netip.MustParsePrefix("10.244.1.0/24").Contains(a) || netip.MustParsePrefix("fd00:244::/64").Contains(a) ||
			netip.MustParsePrefix("11.11.11.0/30").Contains(a) || netip.MustParsePrefix("2a01:ffff::/64").Contains(a) {
			continue
		}
		out = append(out, a)
	}
	slices.SortFunc(out, func(a, b netip.Addr) int { return a.Compare(b) })
	return out
}

func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Addr().AsSlice()
	for i := p.Bits(); i < len(b)*8; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

// TestSameDecisionsAsUpstream runs the corpus under upstream's rules
// (iptables-nft in the node namespace), then under ipmasq with the same
// file and args, and fails on every destination whose decision differs.
func TestSameDecisionsAsUpstream(t *testing.T) {
	privtest.Require(t)
	dsts := destinations(t)
	ref := map[string]map[netip.Addr]outcome{}

	// Upstream: a fresh topology; each case its own UDP port, so no
	// conntrack entry of an earlier case decides for a later one.
	up := newDiffTopology(t)
	for i, c := range upstreamCorpus {
		for _, v6 := range []bool{false, true} {
			for _, rule := range upstreamRules(c, v6) {
				if err := up.node.Iptables(v6, rule...); err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
			}
		}
		for j, src := range diffPodSources {
			ref[c.name+"/"+src.name] = up.probe(t, uint16(20000+1000*j+i), src, dsts)
		}
		for _, v6 := range []bool{false, true} {
			if upstreamRules(c, v6) == nil {
				continue
			}
			for _, rule := range [][]string{
				{"-t", "nat", "-F", "POSTROUTING"}, {"-t", "nat", "-F", "IP-MASQ-AGENT"}, {"-t", "nat", "-X", "IP-MASQ-AGENT"},
			} {
				if err := up.node.Iptables(v6, rule...); err != nil {
					t.Fatalf("%s: clean up: %v", c.name, err)
				}
			}
		}
	}

	for i, c := range upstreamCorpus {
		t.Run(c.name, func(t *testing.T) {
			d := newDiffTopology(t)
			a := newAgent(t, d.node, "")
			if c.file == nil {
				if err := os.Remove(a.config); err != nil {
					t.Fatal(err)
				}
			} else {
				a.writeConfig(*c.file)
			}
			// The e2e default turns IPv6 on; here only the case's args decide.
			a.args = append([]string{"--enable-ipv6=false"}, c.args...)
			if upstreamRules(c, false) == nil {
				// Upstream installs no rule when its first config is
				// invalid; ipmasq attaches no program until a config
				// loads: neither masquerades anything.
				a.startProcess()
			} else {
				a.start()
			}
			waitConfigSettled(t, a)
			for j, src := range diffPodSources {
				got := d.probe(t, uint16(20000+1000*j+i), src, dsts)
				compareDecisions(t, c, src, dsts, ref[c.name+"/"+src.name], got)
			}
			checkUpstreamFlagWarnings(t, a, c.args)
		})
	}
}

// compareDecisions fails on every destination whose decision for src
// differs between upstream (want) and ipmasq (got).
func compareDecisions(t *testing.T, c upstreamCase, src podSource, dsts []netip.Addr, want, got map[netip.Addr]outcome) {
	t.Helper()
	diffs, masq, plain := 0, 0, 0
	firstRange := map[string]int{"upstream": 0, "ipmasq": 0}
	for _, dst := range dsts {
		w, g := want[dst], got[dst]
		switch w.decision() {
		case "masqueraded":
			masq++
		case "not delivered":
		default:
			plain++
		}
		if w.decision() != g.decision() {
			if diffs++; diffs <= 20 {
				t.Errorf("from %s (%s) to %s: upstream %s, ipmasq %s", src.v4, src.name, dst, w, g)
			}
		}
		// --to-ports: both give masqueraded UDP a port of a range.
		if tp := parseUpstreamArgs(c.args).toPorts; tp != "" && g.decision() == "masqueraded" {
			for who, o := range map[string]outcome{"upstream": w, "ipmasq": g} {
				i, ok := inToPorts(t, tp, o.port)
				if !ok {
					t.Errorf("%s: %s masqueraded to port %d, outside --to-ports=%s", dst, who, o.port, tp)
				} else if i == 0 {
					firstRange[who]++
				}
			}
		}
	}
	// Several ranges: each flow draws one by its share of the ports, under
	// both (--to-ports=40000-40009,50000-50019: a third of the flows in
	// the first).
	if tp := parseUpstreamArgs(c.args).toPorts; strings.Contains(tp, ",") {
		for who, n := range firstRange {
			if share := float64(n) / float64(masq); masq < 300 || share < 0.2 || share > 0.47 {
				t.Errorf("from the pod's %s source: %s: %d of %d masqueraded flows in the first range of --to-ports=%s, want about a third",
					src.name, who, n, masq, tp)
			}
		}
	}
	if diffs > 0 {
		t.Fatalf("from the pod's %s source: %d of %d destinations decided differently", src.name, diffs, len(dsts))
	}
	t.Logf("from the pod's %s source, %d destinations: %d masqueraded, %d not masqueraded, %d not delivered, under both",
		src.name, len(dsts), masq, plain, len(dsts)-masq-plain)
}

// waitConfigSettled waits until the agent has applied (or rejected) its
// config: the ipmasq-config table's generation moved past 0, or an error
// was recorded.
func waitConfigSettled(t *testing.T, a *agent) {
	t.Helper()
	a.waitFor("the config applied or rejected", func() bool {
		data, err := os.ReadFile(a.log)
		return err == nil && (strings.Contains(string(data), `msg="Config applied"`) || strings.Contains(string(data), "Config file rejected") ||
			strings.Contains(string(data), "level=ERROR"))
	})
	// The maps' reconciler runs after the table is written.
	time.Sleep(200 * time.Millisecond)
}

// checkUpstreamFlagWarnings: each ignored upstream flag given gives one
// warning line naming it.
func checkUpstreamFlagWarnings(t *testing.T, a *agent, args []string) {
	t.Helper()
	data, err := os.ReadFile(a.log)
	if err != nil {
		t.Fatal(err)
	}
	for _, arg := range args {
		name, _, _ := strings.Cut(strings.TrimLeft(arg, "-"), "=")
		switch name {
		// --random-fully has its effect (--nat-random-fully): no warning.
		case "masq-chain", "v", "logtostderr":
		default:
			continue
		}
		if n := strings.Count(string(data), "flag=\"--"+name+"="); n != 1 {
			t.Errorf("%d warning lines for %s, want 1", n, arg)
		}
	}
}

// TestLeftoverUpstreamRulesReported: the Kubernetes agent's chain left in
// the node (as it writes it) and a plain MASQUERADE rule for the pods are
// reported by the agent, read-only: one warning line, the status, the
// metric, and the rules are still there afterwards, untouched.
func TestLeftoverUpstreamRulesReported(t *testing.T) {
	d := newDiffTopology(t)
	for _, v6 := range []bool{false, true} {
		for _, rule := range upstreamRules(upstreamCorpus[0], v6) {
			if err := d.node.Iptables(v6, rule...); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := d.node.Iptables(false, "-t", "nat", "-A", "POSTROUTING", "-s", "10.244.0.0/16", "-o", "eth0", "-j", "MASQUERADE"); err != nil {
		t.Fatal(err)
	}
	before := iptablesSave(t, d.node)

	a := newAgent(t, d.node, "nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	a.args = []string{"--prometheus-serve-addr=127.0.0.1:9464"}
	a.start()
	want := []string{
		"ip nat chain IP-MASQ-AGENT (ip-masq-agent-chain)",
		"ip nat IP-MASQ-AGENT handle", ": masquerade from any",
		"ip nat POSTROUTING handle", ": masquerade from 10.244.0.0/16",
	}
	var status string
	a.waitFor("the status to report the rules", func() bool {
		out, err := exec.Command(agentBin, "status", "--shell-sock-path="+a.dir+"/shell.sock").CombinedOutput()
		status = string(out)
		return err == nil && strings.Contains(status, "Netfilter:  3 NAT rule(s) decide before ipmasq")
	})
	for _, w := range want {
		if !strings.Contains(status, w) {
			t.Errorf("status lacks %q:\n%s", w, status)
		}
	}
	// Dialled on the thread inside the node namespace (http.Get would dial
	// from another goroutine, outside it).
	var conn net.Conn
	if err := d.node.Do(func() (err error) {
		conn, err = net.Dial("tcp", "127.0.0.1:9464")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET /metrics HTTP/1.0\r\nHost: agent\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	metrics := string(body)
	if !strings.Contains(metrics, "\nipmasq_netfilter_nat_rules 3\n") {
		t.Errorf("metrics lack ipmasq_netfilter_nat_rules 3:\n%s", grepLines(metrics, "netfilter"))
	}
	log, err := os.ReadFile(a.log)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(log), `msg="Netfilter NAT rules decide before ipmasq`); n != 1 {
		t.Errorf("%d warning lines about the rules, want 1", n)
	}
	if after := iptablesSave(t, d.node); after != before {
		t.Errorf("the agent changed netfilter:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// iptablesSave lists the node's IPv4 and IPv6 nat rules.
func iptablesSave(t *testing.T, n *topology.Netns) string {
	t.Helper()
	var out strings.Builder
	for _, bin := range []string{"iptables-nft", "ip6tables-nft"} {
		cmd := exec.Command(bin, "-w", "-t", "nat", "-S")
		var b strings.Builder
		cmd.Stdout, cmd.Stderr = &b, &b
		if err := n.Start(cmd); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Fatalf("%s: %v: %s", bin, err, b.String())
		}
		out.WriteString(b.String())
	}
	return out.String()
}
