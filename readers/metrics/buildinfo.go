package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipmasq/ipmasq/internal/buildinfo"
	"github.com/ipmasq/ipmasq/tables"
)

// newBuildInfo is ipmasq_build_info: constant 1, its labels name the
// running build, so a dashboard can tell which nodes run which version
// during a rollout (the same version as `ipmasq-agent --version`, the
// start log line and the image tag).
func newBuildInfo() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "ipmasq_build_info",
		Help: "Constant 1; the labels are the agent's version (git describe at build time), VCS revision and Go release.",
		ConstLabels: prometheus.Labels{
			"version":   buildinfo.Version(),
			"revision":  buildinfo.Revision(),
			"goversion": buildinfo.GoVersion(),
		},
	})
	g.Set(1)
	return g
}

// newDatapathInfo is ipmasq_datapath_info: constant 1, its labels name the
// build of the programs the agent loaded for the node's kernel
// (bpf.ChooseVariant), why, and the attach mode asked for: a dashboard
// tells which nodes run the compat build.
func newDatapathInfo(v tables.DatapathVariant) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "ipmasq_datapath_info",
		Help: "Constant 1; the labels are the datapath build loaded (full or compat), why, and --tc-attach-mode.",
		ConstLabels: prometheus.Labels{
			"variant":     v.Variant,
			"reason":      v.Reason,
			"attach_mode": v.AttachMode,
		},
	})
	g.Set(1)
	return g
}
