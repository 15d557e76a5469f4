package e2e

import (
	"net/netip"
	"testing"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// A masquerader makes the node of a fresh topology masquerade the pods.
type masquerader struct {
	name  string
	start func(t *testing.T, topo *topology.Masquerade)
}

// linuxMasquerade is the reference: iptables-nft MASQUERADE on the node.
var linuxMasquerade = masquerader{name: "MASQUERADE", start: func(t *testing.T, topo *topology.Masquerade) {
	for _, r := range []struct {
		v6  bool
		src string
	}{{false, topology.PodCIDR4}, {true, topology.PodCIDR6}} {
		if err := topo.Node.Iptables(r.v6, "-t", "nat", "-A", "POSTROUTING", "-s", r.src, "-o", "eth0", "-j", "MASQUERADE"); err != nil {
			t.Fatal(err)
		}
	}
}}

// linuxMasqueradeOf is linuxMasquerade for other sources, e.g. the tunnel
// clients behind wg0: one MASQUERADE rule per source prefix, -o eth0.
func linuxMasqueradeOf(sources ...string) masquerader {
	return masquerader{name: "MASQUERADE", start: func(t *testing.T, topo *topology.Masquerade) {
		for _, src := range sources {
			if err := topo.Node.Iptables(netip.MustParsePrefix(src).Addr().Is6(), "-t", "nat", "-A", "POSTROUTING", "-s", src, "-o", "eth0", "-j", "MASQUERADE"); err != nil {
				t.Fatal(err)
			}
		}
	}}
}

// runEach runs scenario once per masquerader, each on a topology of its own.
func runEach(t *testing.T, ms []masquerader, scenario func(t *testing.T, topo *topology.Masquerade)) {
	t.Helper()
	runEachWith(t, topology.Options{}, ms, scenario)
}

// runEachWith is runEach on topologies built with opts (an L3 uplink, a
// smaller pod MTU, ...).
func runEachWith(t *testing.T, opts topology.Options, ms []masquerader, scenario func(t *testing.T, topo *topology.Masquerade)) {
	t.Helper()
	for _, m := range ms {
		t.Run(m.name, func(t *testing.T) {
			topo, err := topology.NewMasqueradeWith(opts)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { topo.Close() })
			m.start(t, topo)
			scenario(t, topo)
		})
	}
}
