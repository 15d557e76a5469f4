package metrics

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestReconcilerMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	var m reconciler.Metrics = NewReconcilerMetrics(reg)
	maps := cell.FullModuleID{"nonmasq-maps"}
	rules := cell.FullModuleID{"agent", "ip-rules"}

	// Two rounds of the maps: 2 objects fail, then one of them is fixed.
	m.ReconciliationDuration(maps, "nonmasq-maps", reconciler.OpUpdate, 2*time.Millisecond)
	m.ReconciliationDuration(maps, "nonmasq-maps", reconciler.OpDelete, 50*time.Microsecond)
	m.ReconciliationErrors(maps, "nonmasq-maps", 2, 2)
	m.ReconciliationDuration(maps, "nonmasq-maps", reconciler.OpUpdate, time.Millisecond)
	m.ReconciliationErrors(maps, "nonmasq-maps", 0, 1)
	// A prune that succeeds, then one that fails.
	m.PruneDuration(maps, "nonmasq-maps", 20*time.Millisecond)
	m.PruneError(maps, "nonmasq-maps", nil)
	m.PruneDuration(maps, "nonmasq-maps", 5*time.Second)
	m.PruneError(maps, "nonmasq-maps", errors.New("dump map: permission denied"))
	// Another reconciler, nested module, clean round.
	m.ReconciliationErrors(rules, "ip-rules", 0, 0)
	m.PruneError(rules, "ip-rules", nil)

	want := `
# HELP ipmasq_reconciler_current_errors Objects whose last update or delete failed and that wait for a retry, after the last round.
# TYPE ipmasq_reconciler_current_errors gauge
ipmasq_reconciler_current_errors{module="agent.ip-rules",reconciler="ip-rules"} 0
ipmasq_reconciler_current_errors{module="nonmasq-maps",reconciler="nonmasq-maps"} 1
# HELP ipmasq_reconciler_errors_total Failed update and delete operations in incremental rounds, retries included.
# TYPE ipmasq_reconciler_errors_total counter
ipmasq_reconciler_errors_total{module="agent.ip-rules",reconciler="ip-rules"} 0
ipmasq_reconciler_errors_total{module="nonmasq-maps",reconciler="nonmasq-maps"} 2
# HELP ipmasq_reconciler_last_prune_successful 1 if the last prune succeeded, 0 if it failed; absent before the first prune.
# TYPE ipmasq_reconciler_last_prune_successful gauge
ipmasq_reconciler_last_prune_successful{module="agent.ip-rules",reconciler="ip-rules"} 1
ipmasq_reconciler_last_prune_successful{module="nonmasq-maps",reconciler="nonmasq-maps"} 0
# HELP ipmasq_reconciler_prune_errors_total Prunes that failed.
# TYPE ipmasq_reconciler_prune_errors_total counter
ipmasq_reconciler_prune_errors_total{module="agent.ip-rules",reconciler="ip-rules"} 0
ipmasq_reconciler_prune_errors_total{module="nonmasq-maps",reconciler="nonmasq-maps"} 1
# HELP ipmasq_reconciler_prunes_total Prunes: full comparisons with the target that remove what the table does not hold.
# TYPE ipmasq_reconciler_prunes_total counter
ipmasq_reconciler_prunes_total{module="agent.ip-rules",reconciler="ip-rules"} 1
ipmasq_reconciler_prunes_total{module="nonmasq-maps",reconciler="nonmasq-maps"} 2
# HELP ipmasq_reconciler_rounds_total Incremental reconciliation rounds (a batch of table changes and due retries).
# TYPE ipmasq_reconciler_rounds_total counter
ipmasq_reconciler_rounds_total{module="agent.ip-rules",reconciler="ip-rules"} 1
ipmasq_reconciler_rounds_total{module="nonmasq-maps",reconciler="nonmasq-maps"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"ipmasq_reconciler_current_errors", "ipmasq_reconciler_errors_total",
		"ipmasq_reconciler_last_prune_successful", "ipmasq_reconciler_prune_errors_total",
		"ipmasq_reconciler_prunes_total", "ipmasq_reconciler_rounds_total"); err != nil {
		t.Fatal(err)
	}

	// The durations: one series per module, reconciler and operation, each
	// observation in its bucket.
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	type key struct{ module, op string }
	got := map[key]uint64{}
	var sum float64
	for _, mf := range families {
		if mf.GetName() != "ipmasq_reconciler_operation_duration_seconds" {
			continue
		}
		for _, metric := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range metric.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			got[key{labels["module"], labels["operation"]}] = metric.GetHistogram().GetSampleCount()
			sum += metric.GetHistogram().GetSampleSum()
		}
	}
	want2 := map[key]uint64{
		{"nonmasq-maps", "update"}: 2,
		{"nonmasq-maps", "delete"}: 1,
		{"nonmasq-maps", "prune"}:  2,
	}
	if len(got) != len(want2) {
		t.Fatalf("duration series: got %v, want %v", got, want2)
	}
	for k, n := range want2 {
		if got[k] != n {
			t.Fatalf("duration series: got %v, want %v", got, want2)
		}
	}
	if wantSum := 0.002 + 0.00005 + 0.001 + 0.02 + 5; sum < wantSum-1e-9 || sum > wantSum+1e-9 {
		t.Fatalf("duration sum %v, want %v", sum, wantSum)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) > 0 {
		t.Fatalf("lint: %v %v", problems, err)
	}
}
