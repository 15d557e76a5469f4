package metrics

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/cells/config"
	"github.com/ipmasq/ipmasq/readers/readiness"
	"github.com/ipmasq/ipmasq/settings"
)

// TestReadyzLivez: /readyz is the readiness probe (what the node can do:
// here, a config loaded), /livez the liveness probe (the agent answers),
// /healthz every degraded scope. An agent that never loaded a config is
// not ready, yet live; a rejected edit with the last good config in force
// leaves it ready (and /healthz 503), so a bad ConfigMap stops no
// rollout and restarts nothing.
func TestReadyzLivez(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ip-masq-agent")
	// A directory where the file should be: no config can be loaded.
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = cell.ModuleDecorators{
		func(h cell.Health, id cell.ModuleID) cell.Health { return h.NewScope(string(id)) },
	}
	var srv *Server
	h := hive.NewWithOptions(opts,
		statedb.Cell, job.Cell, cell.SimpleHealthCell,
		settings.Cell, config.Cell, readiness.Cell,
		Cell,
		cell.Invoke(func(s *Server) { srv = s }),
	)
	hive.AddConfigOverride(h, func(c *config.Config) { c.IPMasqAgentConfigPath = path })
	hive.AddConfigOverride(h, func(c *Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	base := "http://" + srv.Addr().String()

	until := func(path string, code int, contains string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			c, body := get(t, base+path)
			if c == code && strings.Contains(body, contains) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d %q, want %d containing %q", path, c, body, code, contains)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	until("/readyz", http.StatusServiceUnavailable, "not ready: 1 conditions\nconfig: no config loaded yet from "+path)
	until("/healthz", http.StatusServiceUnavailable, "readiness.job-report: Degraded: not ready: config: no config loaded yet")
	until("/livez", http.StatusOK, "ok\n")

	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	writeConfig(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	until("/readyz", http.StatusOK, "ready\n")
	until("/healthz", http.StatusOK, "ok\n")

	writeConfig(t, path, "nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	until("/healthz", http.StatusServiceUnavailable, "config.config-file: Degraded")
	until("/readyz", http.StatusOK, "ready\n")
	until("/livez", http.StatusOK, "ok\n")
}
