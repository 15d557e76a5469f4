package ipmasq_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/cells/agent"
	"github.com/ipmasq/ipmasq/internal/privtest"
	"github.com/ipmasq/ipmasq/reconcilers/bpfmap"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/tables"
)

// benchAgent is a running agent hive with hooks to wait for convergence.
type benchAgent struct {
	b          *testing.B
	configPath string
	db         *statedb.DB
	status     statedb.Table[*tables.ConfigStatus]
	maps       *nonmasqmaps.Handle
	generation uint64
}

func startBenchAgent(b *testing.B) *benchAgent {
	bpfRoot := privtest.MountBPFFS(b)
	a := &benchAgent{b: b, configPath: filepath.Join(b.TempDir(), "config", "ip-masq-agent")}
	h := agent.New(cell.Invoke(func(db *statedb.DB, st statedb.Table[*tables.ConfigStatus], m *nonmasqmaps.Handle) {
		a.db, a.status, a.maps = db, st, m
	}))
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse([]string{"--bpf-root=" + bpfRoot, "--ip-masq-agent-config-path=" + a.configPath}); err != nil {
		b.Fatal(err)
	}
	log := hivetest.Logger(b, hivetest.LogLevel(slog.LevelWarn))
	if err := h.Start(log, context.Background()); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { h.Stop(log, context.Background()) })
	a.generation = 1
	a.waitConverged()
	return a
}

// write replaces the config file the way the kubelet and editors do.
func (a *benchAgent) write(content []byte) {
	if err := os.MkdirAll(filepath.Dir(a.configPath), 0o755); err != nil {
		a.b.Fatal(err)
	}
	tmp := a.configPath + ".tmp"
	if err := os.WriteFile(tmp, content, 0o644); err != nil {
		a.b.Fatal(err)
	}
	if err := os.Rename(tmp, a.configPath); err != nil {
		a.b.Fatal(err)
	}
	a.generation++
}

// waitConverged waits until the config of the last write is in the table
// and the reconciler has written it into the maps.
func (a *benchAgent) waitConverged() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		rows, watch := a.status.AllWatch(a.db.ReadTxn())
		done := false
		for st := range rows {
			if st.LastError != "" {
				a.b.Fatalf("config rejected: %s", st.LastError)
			}
			done = st.Generation >= a.generation
		}
		if done {
			break
		}
		select {
		case <-watch:
		case <-ctx.Done():
			a.b.Fatalf("config generation %d never applied", a.generation)
		}
	}
	if err := a.maps.WaitReconciled(ctx); err != nil {
		a.b.Fatal(err)
	}
}

func (a *benchAgent) v4Entries() int { return a.maps.Maps().V4.Stats().Entries }

// cidrs returns n distinct /24s inside 10.0.0.0/8.. 11.0.0.0/8, offset by
// seed so consecutive configs differ in every entry.
func cidrs(n, seed int) []string {
	out := make([]string, n)
	for i := range n {
		v := (i + seed*n) % (1 << 16)
		out[i] = fmt.Sprintf("%d.%d.%d.0/24", 30+(seed%2), v>>8, v&0xff)
	}
	return out
}

func configJSON(list []string) []byte {
	data, _ := json.Marshal(map[string]any{"nonMasqueradeCIDRs": list, "masqLinkLocal": true, "masqLinkLocalIPv6": true})
	return data
}

func configYAML(list []string) []byte {
	var b strings.Builder
	b.WriteString("masqLinkLocal: true\nmasqLinkLocalIPv6: true\nnonMasqueradeCIDRs:\n")
	for _, c := range list {
		b.WriteString("  - " + c + "\n")
	}
	return []byte(b.String())
}

// BenchmarkConfigToMaps measures a config file write until the maps hold
// its n prefixes (fsnotify event, parse, table transaction, batch map
// write), beside writing the same n entries with one syscall each.
func BenchmarkConfigToMaps(b *testing.B) {
	for _, n := range []int{10, 1000, 16384} {
		for _, format := range []string{"json", "yaml"} {
			b.Run(fmt.Sprintf("n=%d/agent-%s", n, format), func(b *testing.B) {
				a := startBenchAgent(b)
				encode := configJSON
				if format == "yaml" {
					encode = configYAML
				}
				files := [][]byte{encode(cidrs(n, 0)), encode(cidrs(n, 1))}
				empty := encode([]string{})
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					a.write(empty)
					a.waitConverged()
					b.StartTimer()
					a.write(files[i%2])
					a.waitConverged()
				}
				b.StopTimer()
				if got := a.v4Entries(); got != n {
					b.Fatalf("map holds %d entries, want %d", got, n)
				}
			})
		}
		b.Run(fmt.Sprintf("n=%d/baseline-update-per-entry", n), func(b *testing.B) {
			privtest.Require(b)
			m, err := ebpf.NewMap(bpfmap.LPMTrieSpec("bench", 8, 1, 16384))
			if err != nil {
				b.Fatal(err)
			}
			defer m.Close()
			keys := make([]bpfmap.LPMKeyV4, n)
			for i, c := range cidrs(n, 0) {
				keys[i] = bpfmap.LPMKeyV4From(netip.MustParsePrefix(c))
			}
			var zero uint8
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				for j := range keys {
					m.Delete(&keys[j])
				}
				b.StartTimer()
				for j := range keys {
					if err := m.Update(&keys[j], &zero, ebpf.UpdateAny); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

// BenchmarkConfigChangeOne measures one prefix added to or removed from a
// 1 000-entry file until the maps converge: the common operator edit.
func BenchmarkConfigChangeOne(b *testing.B) {
	a := startBenchAgent(b)
	base := cidrs(1000, 0)
	files := [][]byte{configJSON(base), configJSON(append(base[:1000:1000], "198.18.0.0/15"))}
	a.write(files[0])
	a.waitConverged()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		a.write(files[(i+1)%2])
		a.waitConverged()
	}
}
