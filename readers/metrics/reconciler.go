package metrics

import (
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
)

// ReconcilerMetrics implements reconciler.Metrics with Prometheus. Every
// series is labelled with the reconciler's module ("nonmasq-maps") and
// name (reconciler.WithName; may equal the module).
type ReconcilerMetrics struct {
	duration           *prometheus.HistogramVec
	rounds             *prometheus.CounterVec
	errors             *prometheus.CounterVec
	currentErrors      *prometheus.GaugeVec
	prunes             *prometheus.CounterVec
	pruneErrors        *prometheus.CounterVec
	lastPruneSucceeded *prometheus.GaugeVec
}

var _ reconciler.Metrics = (*ReconcilerMetrics)(nil)

// OpPrune is the operation label of prune durations, next to
// reconciler.OpUpdate and reconciler.OpDelete.
const OpPrune = "prune"

// reconcilerBuckets span a cached map write (tens of µs) to a slow netlink
// or attach round (seconds).
var reconcilerBuckets = []float64{
	0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003,
	0.01, 0.03, 0.1, 0.3, 1, 3, 10,
}

// NewReconcilerMetrics creates the reconciler metrics and registers them
// with reg.
func NewReconcilerMetrics(reg prometheus.Registerer) *ReconcilerMetrics {
	labels := []string{"module", "reconciler"}
	m := &ReconcilerMetrics{
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ipmasq_reconciler_operation_duration_seconds",
			Help:    "Duration of reconciler operations: update and delete (one call per object, or per batch for batch operations) and prune (a full comparison with the target).",
			Buckets: reconcilerBuckets,
		}, []string{"module", "reconciler", "operation"}),
		rounds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ipmasq_reconciler_rounds_total",
			Help: "Incremental reconciliation rounds (a batch of table changes and due retries).",
		}, labels),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ipmasq_reconciler_errors_total",
			Help: "Failed update and delete operations in incremental rounds, retries included.",
		}, labels),
		currentErrors: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ipmasq_reconciler_current_errors",
			Help: "Objects whose last update or delete failed and that wait for a retry, after the last round.",
		}, labels),
		prunes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ipmasq_reconciler_prunes_total",
			Help: "Prunes: full comparisons with the target that remove what the table does not hold.",
		}, labels),
		pruneErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ipmasq_reconciler_prune_errors_total",
			Help: "Prunes that failed.",
		}, labels),
		lastPruneSucceeded: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ipmasq_reconciler_last_prune_successful",
			Help: "1 if the last prune succeeded, 0 if it failed; absent before the first prune.",
		}, labels),
	}
	reg.MustRegister(m.duration, m.rounds, m.errors, m.currentErrors, m.prunes, m.pruneErrors, m.lastPruneSucceeded)
	return m
}

func newReconcilerMetrics(reg *prometheus.Registry) reconciler.Metrics {
	return NewReconcilerMetrics(reg)
}

// ReconciliationDuration implements reconciler.Metrics.
func (m *ReconcilerMetrics) ReconciliationDuration(moduleID cell.FullModuleID, name, operation string, duration time.Duration) {
	m.duration.WithLabelValues(moduleID.String(), name, operation).Observe(duration.Seconds())
}

// ReconciliationErrors implements reconciler.Metrics. It is called once per
// incremental round with the errors new in the round and those outstanding
// after it.
func (m *ReconcilerMetrics) ReconciliationErrors(moduleID cell.FullModuleID, name string, new, current int) {
	mod := moduleID.String()
	m.rounds.WithLabelValues(mod, name).Inc()
	m.errors.WithLabelValues(mod, name).Add(float64(new))
	m.currentErrors.WithLabelValues(mod, name).Set(float64(current))
}

// PruneDuration implements reconciler.Metrics.
func (m *ReconcilerMetrics) PruneDuration(moduleID cell.FullModuleID, name string, duration time.Duration) {
	m.duration.WithLabelValues(moduleID.String(), name, OpPrune).Observe(duration.Seconds())
}

// PruneError implements reconciler.Metrics. It is called after every prune,
// with a nil err when the prune succeeded.
func (m *ReconcilerMetrics) PruneError(moduleID cell.FullModuleID, name string, err error) {
	mod := moduleID.String()
	m.prunes.WithLabelValues(mod, name).Inc()
	// Create the series at 0 so that rate() sees the first failure.
	failures := m.pruneErrors.WithLabelValues(mod, name)
	if err != nil {
		failures.Inc()
		m.lastPruneSucceeded.WithLabelValues(mod, name).Set(0)
	} else {
		m.lastPruneSucceeded.WithLabelValues(mod, name).Set(1)
	}
}
