package iprules_test

import (
	"context"
	"fmt"
	"github.com/ipmasq/ipmasq/testkit/privtest"
	"os/exec"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
)

// benchEndpoints returns n endpoint addresses 10.1.x.y/32.
func benchEndpoints(n int) []string {
	eps := make([]string, n)
	for i := range eps {
		eps[i] = fmt.Sprintf("10.1.%d.%d/32", i/250, i%250+1)
	}
	return eps
}

// ipBatch renders rules as an `ip -batch` script with the same protocol.
func ipBatch(rules []*tables.IPRule) string {
	var sb strings.Builder
	for _, r := range rules {
		fmt.Fprintf(&sb, "rule add priority %d from %s to %s lookup %d protocol %d\n",
			r.Priority, r.From, r.To, r.Table, iprules.Protocol)
	}
	return sb.String()
}

func openBenchNetns(b *testing.B, named bool) *testNetns {
	b.Helper()
	n, err := openNetns(named)
	if err != nil {
		b.Fatal(err)
	}
	return n
}

func closeBenchNetns(b *testing.B, n *testNetns) {
	b.Helper()
	if err := n.Close(); err != nil {
		b.Fatalf("close netns: %v", err)
	}
}

func benchUpdate(b *testing.B, ops *iprules.Ops, rules []*tables.IPRule) {
	for _, r := range rules {
		if err := ops.Update(context.Background(), nil, 0, r); err != nil {
			b.Fatal(err)
		}
	}
}

func runIPBatch(b *testing.B, nsName, script string) {
	cmd := exec.Command("ip", "-n", nsName, "-batch", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("ip -batch: %v\n%s", err, out)
	}
}

// BenchmarkRules measures the rule writes of a node with 1000 endpoints and
// 5 non-masquerade CIDRs, each in a fresh network namespace, against
// `ip -batch` installing the same rules. Compare add-one-cidr-1000 with
// ip-batch-1000 and initial-5000 with ip-batch-5000.
func BenchmarkRules(b *testing.B) {
	privtest.Require(b)
	endpoints := benchEndpoints(1000)
	initial := product(endpoints, eniCIDRs)
	added := product(endpoints, []string{"198.18.0.0/15"})

	// installed returns a namespace holding the initial rules and its Ops.
	installed := func(b *testing.B, named bool) (*testNetns, *iprules.Ops) {
		ns := openBenchNetns(b, named)
		ops := iprules.NewOps(iprules.NewNetlinkTarget(ns.Handle))
		benchUpdate(b, ops, initial)
		return ns, ops
	}

	b.Run("initial-5000", func(b *testing.B) {
		b.StopTimer()
		for range b.N {
			ns := openBenchNetns(b, false)
			ops := iprules.NewOps(iprules.NewNetlinkTarget(ns.Handle))
			b.StartTimer()
			benchUpdate(b, ops, initial)
			b.StopTimer()
			if s := ops.Stats(); s.Adds != uint64(len(initial)) || s.Deletes != 0 {
				b.Fatalf("stats %+v, want %d adds", s, len(initial))
			}
			closeBenchNetns(b, ns)
		}
		b.ReportMetric(float64(len(initial)), "writes/op")
	})

	b.Run("add-one-cidr-1000", func(b *testing.B) {
		b.StopTimer()
		ns, ops := installed(b, false)
		defer closeBenchNetns(b, ns)
		for range b.N {
			before := ops.Stats()
			b.StartTimer()
			benchUpdate(b, ops, added)
			b.StopTimer()
			after := ops.Stats()
			if after.Adds-before.Adds != uint64(len(added)) || after.Deletes != before.Deletes {
				b.Fatalf("stats %+v after %+v, want exactly %d adds", after, before, len(added))
			}
			for _, r := range added {
				if err := ops.Delete(context.Background(), nil, 0, r); err != nil {
					b.Fatal(err)
				}
			}
		}
		b.ReportMetric(float64(len(added)), "writes/op")
	})

	b.Run("restart-0", func(b *testing.B) {
		b.StopTimer()
		ns, _ := installed(b, false)
		defer closeBenchNetns(b, ns)
		for range b.N {
			ops := iprules.NewOps(iprules.NewNetlinkTarget(ns.Handle))
			b.StartTimer()
			if err := ops.Prune(context.Background(), nil, desired(initial...)); err != nil {
				b.Fatal(err)
			}
			benchUpdate(b, ops, initial)
			b.StopTimer()
			if s := ops.Stats(); s != (iprules.Stats{Rules: len(initial)}) {
				b.Fatalf("restart stats %+v, want %d rules and no writes", s, len(initial))
			}
		}
		b.ReportMetric(0, "writes/op")
	})

	if _, err := exec.LookPath("ip"); err != nil {
		b.Log("skipping the ip -batch baselines: iproute2's ip is not installed")
		return
	}
	initialScript, addedScript := ipBatch(initial), ipBatch(added)

	b.Run("ip-batch-5000", func(b *testing.B) {
		b.StopTimer()
		for range b.N {
			ns := openBenchNetns(b, true)
			b.StartTimer()
			runIPBatch(b, ns.Name, initialScript)
			b.StopTimer()
			if keys, err := iprules.NewNetlinkTarget(ns.Handle).List(); err != nil || len(keys) != len(initial) {
				b.Fatalf("ip -batch installed %d owned rules (%v), want %d", len(keys), err, len(initial))
			}
			closeBenchNetns(b, ns)
		}
		b.ReportMetric(float64(len(initial)), "writes/op")
	})

	b.Run("ip-batch-1000", func(b *testing.B) {
		b.StopTimer()
		ns, _ := installed(b, true)
		defer closeBenchNetns(b, ns)
		target := iprules.NewNetlinkTarget(ns.Handle)
		for range b.N {
			b.StartTimer()
			runIPBatch(b, ns.Name, addedScript)
			b.StopTimer()
			for _, r := range added {
				if err := target.Del(r.Key()); err != nil {
					b.Fatal(err)
				}
			}
		}
		b.ReportMetric(float64(len(added)), "writes/op")
	})
}
