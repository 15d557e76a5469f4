package iprules_test

import (
	"context"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// maxStartRounds caps BenchmarkRulesStart's rounds: one is ~20 s on the
// 2-vCPU VM, so make bench's -benchtime 20x (21 rounds with the
// framework's first call) would take seven minutes, and three interleaved
// rounds already give each condition a median.
const maxStartRounds = 3

// BenchmarkRulesStart installs the rules of an agent starting with 10 000
// endpoints (route table 11, two non-masquerade CIDRs: 20 000 rules) into
// a fresh network namespace three ways, interleaved in b.N rounds (at most
// maxStartRounds) so that the VM's load weighs on all of them alike:
//
//   - ip-batch: `ip -batch` of the same rules (one request, one ack each);
//   - per-rule: Ops.Update one rule at a time (the reconciler's path before
//     batching);
//   - pipelined: Ops.UpdateBatch in rounds of 10 000 rows, as the reconciler
//     hands them over, through the agent's target.
//
// It reports each condition's median and the medians of the per-round
// ratios to ip-batch (goal: pipelined ≤ 1.5).
func BenchmarkRulesStart(b *testing.B) {
	privtest.Require(b)
	if _, err := exec.LookPath("ip"); err != nil {
		b.Fatal("iproute2's ip is needed for the ip -batch baseline")
	}
	const endpoints, round = 10000, 10000
	rules := product(benchEndpoints(endpoints), []string{"10.0.0.0/8", "169.254.0.0/16"})
	script := ipBatch(rules)

	fresh := func() *testNetns { return openBenchNetns(b, true) }
	check := func(ns *testNetns, what string) {
		keys, err := iprules.NewNetlinkTarget(ns.Handle).List()
		if err != nil || len(keys) != len(rules) {
			b.Fatalf("%s installed %d owned rules (%v), want %d", what, len(keys), err, len(rules))
		}
		closeBenchNetns(b, ns)
	}
	conditions := []struct {
		name string
		run  func(ns *testNetns)
	}{
		{"ip-batch", func(ns *testNetns) { runIPBatch(b, ns.Name, script) }},
		{"per-rule", func(ns *testNetns) { benchUpdate(b, iprules.NewOps(iprules.NewNetlinkTarget(ns.Handle)), rules) }},
		{"pipelined", func(ns *testNetns) {
			target, err := iprules.NewNetlinkTargetAt(ns.ns)
			if err != nil {
				b.Fatal(err)
			}
			defer target.Close()
			ops := iprules.NewOps(target)
			for chunk := range slices.Chunk(rules, round) {
				batch := entries(chunk...)
				ops.UpdateBatch(context.Background(), nil, batch)
				for _, e := range batch {
					if e.Result != nil {
						b.Fatal(e.Result)
					}
				}
			}
		}},
	}

	took := make(map[string][]time.Duration)
	b.StopTimer()
	for i := range min(b.N, maxStartRounds) {
		for j := range conditions {
			// Rotate the order each round: no condition always goes first.
			c := conditions[(i+j)%len(conditions)]
			ns := fresh()
			start := time.Now()
			c.run(ns)
			took[c.name] = append(took[c.name], time.Since(start))
			check(ns, c.name)
		}
	}
	median := func(d []float64) float64 {
		d = slices.Clone(d)
		slices.Sort(d)
		return d[len(d)/2]
	}
	for _, c := range conditions {
		var secs, ratio []float64
		for i, d := range took[c.name] {
			secs = append(secs, d.Seconds())
			ratio = append(ratio, d.Seconds()/took["ip-batch"][i].Seconds())
		}
		b.ReportMetric(median(secs), c.name+"-s")
		if c.name != "ip-batch" {
			b.ReportMetric(median(ratio), c.name+"/ip-batch")
		}
		b.Logf("%s: %v", c.name, took[c.name])
	}
	b.ReportMetric(float64(len(rules)), "rules")
	b.ReportMetric(0, "ns/op")
}
