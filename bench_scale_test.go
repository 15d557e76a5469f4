package ipmasq_test

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/iprulestest"
)

// BenchmarkEndpointsStart measures the control plane alone at 10 000
// endpoints: an agent starts with 10 000 endpoints (route table 11)
// restored from the state file and the seed config (10.0.0.0/8 and
// link-local), and the benchmark waits until the rule reconciler has made
// all 20 000 writes into an in-memory target, so that the kernel's own
// cost (BenchmarkAgentMemory in testkit/e2e has it) does not hide ours.
// The work happens once, whatever b.N; run it with -cpuprofile or
// -memprofile for the profile of the 10 000-endpoint case.
func BenchmarkEndpointsStart(b *testing.B) {
	const endpoints = 10000
	stateDir := b.TempDir()
	eps := make([]*tables.Endpoint, 0, endpoints)
	for i := range endpoints {
		eps = append(eps, &tables.Endpoint{
			IP: netip.AddrFrom4([4]byte{10, 96, byte((i + 1) >> 8), byte(i + 1)}), Owner: fmt.Sprintf("pod-%d", i),
			RouteTable: 11, Created: time.Unix(0, 0).UTC(),
		})
	}
	store, err := ipam.NewStore(stateDir)
	if err != nil {
		b.Fatal(err)
	}
	if err := store.Save(eps); err != nil {
		b.Fatal(err)
	}
	configPath := filepath.Join(b.TempDir(), "ip-masq-agent")
	if err := os.WriteFile(configPath, []byte("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: false\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	a := startBenchAgentWith(b, iprulestest.NewMemoryTarget(), "--state-dir="+stateDir, "--pod-cidr=10.96.0.0/16",
		"--ip-masq-agent-config-path="+configPath)
	a.configPath = configPath
	a.waitRuleWrites(2 * endpoints)
	took := time.Since(start)
	b.Run("endpoints=10000", func(b *testing.B) {
		b.ReportMetric(took.Seconds()*1000, "start-to-20000-rules-ms")
		b.ReportMetric(0, "ns/op")
	})
}
