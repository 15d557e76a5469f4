package metrics

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/ipmasq/ipmasq/cells/config"
	"github.com/ipmasq/ipmasq/internal/buildinfo"
	"github.com/ipmasq/ipmasq/settings"
)

// newConfigHive is the smallest useful hive: the config cell and the
// metrics, with a health scope per module as in the agent.
func newConfigHive(t *testing.T, path, addr string) (*hive.Hive, *Server) {
	var srv *Server
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = cell.ModuleDecorators{
		func(h cell.Health, id cell.ModuleID) cell.Health { return h.NewScope(string(id)) },
	}
	h := hive.NewWithOptions(opts,
		statedb.Cell, job.Cell, cell.SimpleHealthCell,
		settings.Cell, config.Cell,
		Cell,
		cell.Invoke(func(s *Server) { srv = s }),
	)
	hive.AddConfigOverride(h, func(c *config.Config) { c.IPMasqAgentConfigPath = path })
	hive.AddConfigOverride(h, func(c *settings.Config) { c.EnableIPv6 = true }) // --enable-ipv6
	hive.AddConfigOverride(h, func(c *Config) { c.PrometheusServeAddr = addr })
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Stop(log, context.Background()); err != nil {
			t.Error(err)
		}
	})
	return h, srv
}

func writeConfig(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path+".tmp", []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

// get returns the status and body of an HTTP GET.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}

// samples parses a text exposition into series → value.
func samples(t *testing.T, body string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("exposition line %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	return out
}

// waitFor scrapes until every series has its value, or fails with the last
// differences.
func waitFor(t *testing.T, url string, want map[string]float64) map[string]float64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, body := get(t, url)
		got := samples(t, body)
		var diff []string
		for k, v := range want {
			if g, ok := got[k]; !ok || g != v {
				diff = append(diff, k+": got "+strconv.FormatFloat(g, 'g', -1, 64)+", want "+strconv.FormatFloat(v, 'g', -1, 64))
			}
		}
		if len(diff) == 0 {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics never matched:\n%s", strings.Join(diff, "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestConfigMetricsAndHealth follows an operator's session: a good file,
// a rejected one, a good one again, with /metrics and /healthz after each.
func TestConfigMetricsAndHealth(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	writeConfig(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\nmasqueradeCIDRs: [10.96.0.0/12]\n")
	start := time.Now()
	_, srv := newConfigHive(t, path, "127.0.0.1:0")
	if srv.Addr() == nil {
		t.Fatal("Addr() is nil after start")
	}
	base := "http://" + srv.Addr().String()

	// 1. The first load counts, its prefixes are reported, health is OK.
	got := waitFor(t, base+"/metrics", map[string]float64{
		"ipmasq_config_loads_total":                     1,
		"ipmasq_config_load_failures_total":             0,
		"ipmasq_config_valid":                           1,
		"ipmasq_config_generation":                      1,
		`ipmasq_config_nonmasq_prefixes{family="ipv4"}`: 3, // + 169.254.0.0/16
		`ipmasq_config_nonmasq_prefixes{family="ipv6"}`: 1, // fe80::/10
		"ipmasq_config_masquerade_prefixes":             1,
		"ipmasq_config_masquerade_rules":                0,
		`ipmasq_config_warnings{kind="unknown-key"}`:    0,
		`ipmasq_config_warnings{kind="conflict"}`:       0,
	})
	firstLoad := got["ipmasq_config_last_good_load_timestamp_seconds"]
	if firstLoad < float64(start.Unix()) || firstLoad > float64(time.Now().Unix()+1) {
		t.Fatalf("last good load %v, want between %v and now", firstLoad, start.Unix())
	}
	buildInfo := `ipmasq_build_info{goversion="` + buildinfo.GoVersion() + `",revision="` + buildinfo.Revision() + `",version="` + buildinfo.Version() + `"}`
	if got[buildInfo] != 1 {
		t.Errorf("%s = %v, want 1", buildInfo, got[buildInfo])
	}
	for _, name := range []string{"go_goroutines", "process_start_time_seconds"} {
		if _, ok := got[name]; !ok {
			t.Errorf("%s missing: the Go and process collectors are not registered", name)
		}
	}
	if code, body := get(t, base+"/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("/healthz after a good load: %d %q", code, body)
	}
	_, metricsBody := get(t, base+"/metrics")
	problems, err := promlint.New(strings.NewReader(metricsBody)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, "ipmasq_") {
			t.Errorf("lint: %s: %s", p.Metric, p.Text)
		}
	}

	// 2. A rejected file: one failure, not valid, the applied counts stay,
	// /healthz is 503 and names the config scope and the error.
	writeConfig(t, path, "nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	waitFor(t, base+"/metrics", map[string]float64{
		"ipmasq_config_loads_total":                      1,
		"ipmasq_config_load_failures_total":              1,
		"ipmasq_config_valid":                            0,
		"ipmasq_config_generation":                       1,
		`ipmasq_config_nonmasq_prefixes{family="ipv4"}`:  3,
		"ipmasq_config_masquerade_prefixes":              1,
		"ipmasq_config_last_good_load_timestamp_seconds": firstLoad,
	})
	code, body := get(t, base+"/healthz")
	if code != http.StatusServiceUnavailable {
		t.Fatalf("/healthz after a rejected file: %d %q, want 503", code, body)
	}
	for _, want := range []string{"config.config-file: Degraded", "10.0.0.1/8 has host bits set"} {
		if !strings.Contains(body, want) {
			t.Fatalf("/healthz body lacks %q:\n%s", want, body)
		}
	}

	// 3. A good file again: the load counts, the failure stays counted.
	writeConfig(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n")
	waitFor(t, base+"/metrics", map[string]float64{
		"ipmasq_config_loads_total":                     2,
		"ipmasq_config_load_failures_total":             1,
		"ipmasq_config_valid":                           1,
		"ipmasq_config_generation":                      2,
		`ipmasq_config_nonmasq_prefixes{family="ipv4"}`: 1,
		`ipmasq_config_nonmasq_prefixes{family="ipv6"}`: 1,
		"ipmasq_config_masquerade_prefixes":             0,
	})
	if code, body := get(t, base+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz after a good file again: %d %q", code, body)
	}

	// 4. A second, different rejection counts again.
	writeConfig(t, path, "nonMasqueradeCIDRs: [not-a-cidr]\n")
	waitFor(t, base+"/metrics", map[string]float64{
		"ipmasq_config_load_failures_total": 2,
		"ipmasq_config_valid":               0,
	})

	// 5. Unknown keys: the file is applied, each unknown key is a warning,
	// health stays OK.
	writeConfig(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncIntervall: 60s\nfoo: 1\n")
	waitFor(t, base+"/metrics", map[string]float64{
		"ipmasq_config_valid":                           1,
		"ipmasq_config_generation":                      3,
		`ipmasq_config_nonmasq_prefixes{family="ipv4"}`: 2,
		`ipmasq_config_warnings{kind="unknown-key"}`:    2,
		`ipmasq_config_warnings{kind="conflict"}`:       0,
	})
	if code, body := get(t, base+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz with unknown keys: %d %q, want 200", code, body)
	}
}

// TestServerOff: without --prometheus-serve-addr nothing listens.
func TestServerOff(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	_, srv := newConfigHive(t, path, "")
	if addr := srv.Addr(); addr != nil {
		t.Fatalf("Addr() = %v with the server off", addr)
	}
}
