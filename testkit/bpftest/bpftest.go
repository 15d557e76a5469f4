// Package bpftest gives tests and benchmarks a map of the datapath on its
// own, with the layout the datapath's loader gives it, without an agent.
// Test tooling only: production code never imports it (the architecture
// test checks it).
package bpftest

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// NonMasqV4 returns the trie nonmasq_v4 of maxEntries entries of a
// datapath loaded for the test alone (nothing pinned, nothing attached),
// which is closed when tb ends: what a benchmark's baseline writes in the
// agent's own map layout.
func NonMasqV4(tb testing.TB, maxEntries uint32) *ebpf.Map {
	tb.Helper()
	privtest.Require(tb)
	dp, err := bpf.Load(bpf.LoadOptions{NonMasqMaxEntries: maxEntries, NATMaxEntries: 1024})
	if err != nil {
		tb.Fatalf("load the datapath for its nonmasq_v4 trie: %v", err)
	}
	tb.Cleanup(func() { dp.Close() })
	return dp.Maps.NonmasqV4
}
