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
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/bpftest"
	"github.com/ipmasq/ipmasq/testkit/iprulestest"
	"github.com/ipmasq/ipmasq/testkit/netnstest"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// benchAgent is a running agent hive with hooks to wait for convergence.
type benchAgent struct {
	b          *testing.B
	configPath string
	db         *statedb.DB
	status     statedb.Table[*tables.ConfigStatus]
	maps       *nonmasqmaps.Handle
	rules      *iprules.Handle
	generation uint64
}

func startBenchAgent(b *testing.B, args ...string) *benchAgent {
	return startBenchAgentWith(b, iprulestest.NewMemoryTarget(), args...)
}

func startBenchAgentWith(b *testing.B, rules iprules.Target, args ...string) *benchAgent {
	bpfRoot := privtest.MountBPFFS(b)
	ns, _ := privtest.NewNetns(b) // the agent must never see the host's devices
	dir := b.TempDir()
	a := &benchAgent{b: b, configPath: filepath.Join(dir, "config", "ip-masq-agent")}
	h := hive.NewWithOptions(agent.Options(), agent.Infrastructure, netnstest.Agent(ns, agent.Cell),
		cell.Provide(func() iprules.Target { return rules }),
		cell.Invoke(func(db *statedb.DB, st statedb.Table[*tables.ConfigStatus], m *nonmasqmaps.Handle, r *iprules.Handle) {
			a.db, a.status, a.maps, a.rules = db, st, m, r
		}))
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse(append([]string{
		"--bpf-root=" + bpfRoot, "--ip-masq-agent-config-path=" + a.configPath,
		"--state-dir=" + filepath.Join(dir, "state"), "--api-socket=" + filepath.Join(dir, "api.sock"),
		"--shell-sock-path=" + filepath.Join(dir, "shell.sock"),
	}, args...)); err != nil {
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
		// A whole new config in place of the old one: the new prefixes
		// are written before the old are deleted (at n=16384 the map is
		// full, and the early write first makes room).
		b.Run(fmt.Sprintf("n=%d/agent-json-swap", n), func(b *testing.B) {
			a := startBenchAgent(b)
			a.alternate(b, configJSON(cidrs(n, 0)), configJSON(cidrs(n, 1)))
			b.StopTimer()
			if got := a.v4Entries(); got != n {
				b.Fatalf("map holds %d entries, want %d", got, n)
			}
		})
		b.Run(fmt.Sprintf("n=%d/baseline-update-per-entry", n), func(b *testing.B) {
			privtest.Require(b)
			m := bpftest.NonMasqV4(b, 16384)
			keys := make([]bpf.LPMKeyV4, n)
			for i, c := range cidrs(n, 0) {
				keys[i] = bpf.LPMKeyV4From(netip.MustParsePrefix(c))
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
	a.alternate(b, configJSON(base), configJSON(append(base[:1000:1000], "198.18.0.0/15")))
}

// alternate writes first and waits until the maps hold it, then times b.N
// writes alternating between second and first, each until the maps
// converge.
func (a *benchAgent) alternate(b *testing.B, first, second []byte) {
	files := [][]byte{first, second}
	a.write(first)
	a.waitConverged()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		a.write(files[(i+1)%2])
		a.waitConverged()
	}
}

// BenchmarkConfigChangeRules measures a config change on a node with 1 000
// endpoints (route table 11, 5 rules each: four CIDRs and link-local)
// through the whole agent: file event, parse,
// rules controller, ip rule reconciler, netlink writes in a network
// namespace made for the benchmark. Each iteration adds or removes one
// prefix, so exactly 1 000 rules are written (checked).
func BenchmarkConfigChangeRules(b *testing.B) {
	const endpoints = 1000
	stateDir := b.TempDir()
	var eps []*tables.Endpoint
	for i := range endpoints {
		eps = append(eps, &tables.Endpoint{
			IP: netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(i%250 + 1)}), Owner: fmt.Sprintf("pod-%d", i),
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
	four := []byte("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 100.64.0.0/10, 192.168.0.0/16]\nmasqLinkLocal: false\n")
	five := []byte("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 100.64.0.0/10, 192.168.0.0/16, 198.18.0.0/15]\nmasqLinkLocal: false\n")

	// The first config is in place before the agent starts, as on a node.
	configPath := filepath.Join(b.TempDir(), "ip-masq-agent")
	if err := os.WriteFile(configPath, four, 0o644); err != nil {
		b.Fatal(err)
	}
	target := iprules.NewNetlinkTarget(privtest.NetlinkHandleInNewNetns(b))
	a := startBenchAgentWith(b, target, "--state-dir="+stateDir, "--pod-cidr=10.1.0.0/16",
		"--ip-masq-agent-config-path="+configPath)
	a.configPath = configPath
	start := time.Now()
	a.waitRuleWrites(5 * endpoints)
	initial := time.Since(start)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		before := a.rules.Stats()
		if i%2 == 0 {
			a.write(five)
		} else {
			a.write(four)
		}
		a.waitRuleWrites(before.Adds + before.Deletes + endpoints)
	}
	b.StopTimer()
	st := a.rules.Stats()
	b.ReportMetric(float64(st.Adds+st.Deletes-5*endpoints)/float64(b.N), "rule-writes/op")
	b.ReportMetric(float64(initial.Milliseconds()), "initial-5000-rules-ms")
}

// waitRuleWrites waits until the rule reconciler has made n writes in all.
func (a *benchAgent) waitRuleWrites(n uint64) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		st := a.rules.Stats()
		switch w := st.Adds + st.Deletes; {
		case w == n:
			return
		case w > n:
			a.b.Fatalf("%d rule writes, want exactly %d", w, n)
		}
		time.Sleep(100 * time.Microsecond)
	}
	a.b.Fatalf("rule writes did not reach %d: %+v", n, a.rules.Stats())
}

// BenchmarkIdleCPU measures the agent's CPU use at steady state with a
// 16 384-prefix config: nothing changes, so it should be close to zero (a
// loop waiting on an always-closed channel once made it 1.2 cores).
func BenchmarkIdleCPU(b *testing.B) {
	a := startBenchAgent(b)
	a.write(configJSON(cidrs(16384, 0)))
	a.waitConverged()
	time.Sleep(500 * time.Millisecond)
	b.ResetTimer()
	var before, after syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &before)
	const window = 2 * time.Second
	time.Sleep(window)
	syscall.Getrusage(syscall.RUSAGE_SELF, &after)
	b.StopTimer()
	used := time.Duration(after.Utime.Nano()-before.Utime.Nano()) + time.Duration(after.Stime.Nano()-before.Stime.Nano())
	b.ReportMetric(float64(used.Milliseconds())/window.Seconds(), "cpu-ms/s")
}
