package metrics

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cells/config"
	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// TestMapsCollectorNotStarted: no map metrics before the maps are open.
func TestMapsCollectorNotStarted(t *testing.T) {
	c := &mapsCollector{maps: bpf.Pinned{Dir: t.TempDir()}, capacity: 16384}
	if n := testutil.CollectAndCount(c); n != 0 {
		t.Fatalf("collected %d metrics before the maps are open, want 0", n)
	}
}

// TestMapMetrics (root): the entries of the real maps follow the config,
// the capacity is --max-nonmasq-cidrs.
func TestMapMetrics(t *testing.T) {
	bpffs := privtest.MountBPFFS(t)
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	writeConfig(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n")
	var srv *Server
	h := hive.New(
		statedb.Cell, job.Cell, cell.SimpleHealthCell,
		settings.Cell, config.Cell,
		// The loader owns the tries nonmasqmaps writes.
		datapath.Cell, nonmasqmaps.Cell,
		Cell,
		cell.Invoke(func(s *Server) { srv = s }),
	)
	hive.AddConfigOverride(h, func(c *settings.Config) { c.BPFRoot = bpffs; c.MaxNonMasqCIDRs = 128; c.EnableIPv6 = true })
	hive.AddConfigOverride(h, func(c *config.Config) { c.IPMasqAgentConfigPath = path })
	hive.AddConfigOverride(h, func(c *Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	url := "http://" + srv.Addr().String() + "/metrics"

	waitFor(t, url, map[string]float64{
		`ipmasq_nonmasq_map_entries{family="ipv4"}`:  3, // + 169.254.0.0/16
		`ipmasq_nonmasq_map_entries{family="ipv6"}`:  1, // fe80::/10
		`ipmasq_nonmasq_map_capacity{family="ipv4"}`: 128,
		`ipmasq_nonmasq_map_capacity{family="ipv6"}`: 128,
	})
	writeConfig(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, fd00::/8]\nmasqLinkLocal: true\n")
	waitFor(t, url, map[string]float64{
		`ipmasq_nonmasq_map_entries{family="ipv4"}`: 3,
		`ipmasq_nonmasq_map_entries{family="ipv6"}`: 2,
	})
}
