package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/bpftest"
)

// prefixes24 returns n distinct /24s in 30.0.0.0/8 and 31.0.0.0/8; seed
// picks the first octet, so consecutive sets differ in every entry.
func prefixes24(n, seed int) []netip.Prefix {
	out := make([]netip.Prefix, n)
	for i := range n {
		out[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(30 + seed%2), byte(i >> 8), byte(i), 0}), 24)
	}
	return out
}

func prefixConfig(ps []netip.Prefix) string {
	var b strings.Builder
	b.WriteString(`{"masqLinkLocal": true, "masqLinkLocalIPv6": true, "nonMasqueradeCIDRs": [`)
	for i, p := range ps {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%q", p)
	}
	b.WriteString("]}\n")
	return b.String()
}

// pollUntil spins on single lookups of the pinned map until key is in it
// (present) or gone (!present), and returns when that was seen.
func pollUntil(b *testing.B, m *ebpf.Map, key bpf.LPMKeyV4, present bool) time.Time {
	var v uint8
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		err := m.Lookup(&key, &v)
		if (err == nil) == present {
			return time.Now()
		}
	}
	b.Fatalf("pinned map: %v never became present=%v", key, present)
	return time.Time{}
}

// naiveWrite writes ps into a fresh LPM trie with one update syscall each:
// what a naive agent does once it has parsed the file.
func naiveWrite(b *testing.B, ps []netip.Prefix) time.Duration {
	m := bpftest.NonMasqV4(b, 16384) // the agent's own map layout
	var zero uint8
	start := time.Now()
	for _, p := range ps {
		k := bpf.LPMKeyV4From(p)
		if err := m.Update(&k, &zero, ebpf.UpdateAny); err != nil {
			b.Fatal(err)
		}
	}
	return time.Since(start)
}

// BenchmarkConfigToPinnedMap measures, from outside the agent process, the
// time from a config file replaced with write + rename to the pinned map
// holding the change, seen by a poller spinning on single lookups: n new
// prefixes (every entry different), and one prefix added to or removed
// from a 1 000-prefix file. The baseline, interleaved in the same rounds,
// writes the same n prefixes with one update syscall each. Reports the
// medians and the median of per-round ratios, and, as write-rename-ms, the
// writer's own part of the figure: the same write + rename into a directory
// nobody watches (on ext4 it is most of the 10-prefix figure).
func BenchmarkConfigToPinnedMap(b *testing.B) {
	const rounds = 15
	topo, err := topology.NewMasquerade()
	if err != nil {
		b.Fatal(err)
	}
	defer topo.Close()
	a := newAgent(b, topo.Node, prefixConfig(nil))
	a.start()
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", bpf.MapNonMasqV4), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()

	// The writer's own part of the figure: the same write + rename into a
	// directory nobody watches, on the same filesystem.
	unwatched := filepath.Join(b.TempDir(), "ip-masq-agent")
	writeAlone := func(content string) time.Duration {
		start := time.Now()
		if err := os.WriteFile(unwatched+".tmp", []byte(content), 0o644); err != nil {
			b.Fatal(err)
		}
		if err := os.Rename(unwatched+".tmp", unwatched); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}

	type figure struct{ agent, naive, ratio, writer []float64 }
	figures := map[string]*figure{}
	record := func(name string, agent, naive, writer time.Duration) {
		f := figures[name]
		if f == nil {
			f = &figure{}
			figures[name] = f
		}
		f.agent = append(f.agent, agent.Seconds()*1000)
		f.naive = append(f.naive, naive.Seconds()*1000)
		f.ratio = append(f.ratio, float64(agent)/float64(naive))
		f.writer = append(f.writer, writer.Seconds()*1000)
	}
	for r := range rounds {
		for _, n := range []int{10, 1000, 16000} {
			a.writeConfig(prefixConfig(nil))
			a.waitFor("the map to empty", func() bool { v4, _ := a.mapEntries(); return v4 == 0 })
			next := prefixes24(n, r)
			content := prefixConfig(next) // made before the clock starts: the figure is write → map
			start := time.Now()
			a.writeConfig(content)
			seen := pollUntil(b, m, bpf.LPMKeyV4From(next[n-1]), true)
			a.waitFor("the whole config", func() bool { v4, _ := a.mapEntries(); return v4 == n })
			record(fmt.Sprintf("n=%d", n), seen.Sub(start), naiveWrite(b, next), writeAlone(content))
		}
		// One prefix more or less in a 1 000-prefix file.
		base := prefixes24(1000, 0)
		a.writeConfig(prefixConfig(base))
		a.waitFor("1 000 prefixes", func() bool { v4, _ := a.mapEntries(); return v4 == 1000 })
		extra := netip.MustParsePrefix("198.18.0.0/15")
		withExtra, without := prefixConfig(append(slices.Clone(base), extra)), prefixConfig(base)
		start := time.Now()
		a.writeConfig(withExtra)
		added := pollUntil(b, m, bpf.LPMKeyV4From(extra), true).Sub(start)
		start = time.Now()
		a.writeConfig(without)
		removed := pollUntil(b, m, bpf.LPMKeyV4From(extra), false).Sub(start)
		naive := naiveWrite(b, base)
		record("one-changed-in-1000", added, naive, writeAlone(withExtra))
		record("one-changed-in-1000", removed, naive, writeAlone(without))
	}

	median := func(v []float64) float64 { v = slices.Clone(v); slices.Sort(v); return v[len(v)/2] }
	for _, name := range []string{"n=10", "n=1000", "n=16000", "one-changed-in-1000"} {
		f := figures[name]
		b.Logf("%s: agent %.2f ms, naive per-entry write %.2f ms, ratio %.2f, the writer's write + rename alone %.2f ms (medians of %d)",
			name, median(f.agent), median(f.naive), median(f.ratio), median(f.writer), len(f.ratio))
		b.Run(name, func(b *testing.B) {
			b.ReportMetric(median(f.agent), "agent-ms")
			b.ReportMetric(median(f.naive), "naive-write-ms")
			b.ReportMetric(median(f.ratio), "agent/naive")
			b.ReportMetric(median(f.writer), "write-rename-ms")
			b.ReportMetric(0, "ns/op")
		})
	}
}
