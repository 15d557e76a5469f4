package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/promtooltest"
)

// metricName finds the metric names of a PromQL expression: the agent's
// (ipmasq_*) and the Go and process collectors' it exports too.
var metricName = regexp.MustCompile(`\b(?:ipmasq|go|process)_[a-zA-Z0-9_:]*`)

// TestDashboardAndAlerts: promtool check metrics finds nothing to say about
// a live agent's /metrics (after traffic, so every datapath series
// exists); every query of deploy/grafana/ipmasq.json parses and, with every
// alert of
// deploy/prometheus/ipmasq-rules.yaml names only metrics that agent
// exports; promtool check rules accepts the alerts, and promtool test rules
// runs their unit tests (deploy/prometheus/ipmasq-rules.test.yaml).
func TestDashboardAndAlerts(t *testing.T) {
	promtool, err := promtooltest.Binary()
	if err != nil {
		t.Fatalf("promtool (built from tools/promtool): %v", err)
	}
	topo, _, ext := setup(t, masqueradeAll, "--prometheus-serve-addr="+metricsAddr)
	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 1)
	checkSource(t, topo, ext, topology.RemoteIP6, topology.NodeIP6, 1)
	_, body := scrape(t, topo.Node, "/metrics")

	check := exec.Command(promtool, "check", "metrics")
	check.Stdin = strings.NewReader(body)
	if out, err := check.CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}

	exported := map[string]bool{}
	for line := range strings.Lines(body) {
		if strings.HasPrefix(line, "#") || strings.TrimSpace(line) == "" {
			continue
		}
		name, _, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		exported[name] = true
	}
	checkNames := func(where, expr string) {
		t.Helper()
		names := metricName.FindAllString(expr, -1)
		if len(names) == 0 {
			t.Errorf("%s: %q names no metric of the agent", where, expr)
		}
		for _, n := range names {
			if !exported[n] {
				t.Errorf("%s: %q names %s, which the agent does not export", where, expr, n)
			}
		}
	}

	root := repoRoot(t)
	exprs := dashboardQueries(t, filepath.Join(root, "deploy", "grafana", "ipmasq.json"))
	if len(exprs) < 10 {
		t.Fatalf("the dashboard has %d queries; the file is not read right", len(exprs))
	}
	for where, e := range exprs {
		checkNames(where, e)
	}
	// The queries parse: promtool checks them as recording rules, with
	// Grafana's variables replaced by values a query could have.
	grafanaVars := strings.NewReplacer("$__rate_interval", "5m", "$instance", ".*", "$device", ".*")
	var recording strings.Builder
	recording.WriteString("groups:\n- name: dashboard\n  rules:\n")
	i := 0
	for where, e := range exprs {
		if strings.HasPrefix(where, "variable ") {
			continue // label_values(...) is Grafana's, not PromQL
		}
		quoted, _ := json.Marshal(grafanaVars.Replace(e))
		fmt.Fprintf(&recording, "  - record: dashboard:query%d\n    expr: %s\n", i, quoted)
		i++
	}
	queriesFile := filepath.Join(t.TempDir(), "dashboard-queries.yaml")
	if err := os.WriteFile(queriesFile, []byte(recording.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "check", "rules", queriesFile).CombinedOutput(); err != nil {
		t.Errorf("the dashboard's queries do not parse (promtool check rules): %v\n%s", err, out)
	}

	// The PrometheusRule's groups are a plain rule file for promtool.
	data, err := os.ReadFile(filepath.Join(root, "deploy", "prometheus", "ipmasq-rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var rule struct {
		Kind string
		Spec struct {
			Groups []struct {
				Name  string
				Rules []struct {
					Alert string
					Expr  string
				}
			}
		}
	}
	if err := yaml.Unmarshal(data, &rule); err != nil {
		t.Fatalf("ipmasq-rules.yaml: %v", err)
	}
	var generic struct{ Spec json.RawMessage }
	if err := yaml.Unmarshal(data, &generic); err != nil {
		t.Fatal(err)
	}
	groups, err := yaml.JSONToYAML(generic.Spec)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	rulesFile := filepath.Join(dir, "ipmasq-rules.yaml")
	if err := os.WriteFile(rulesFile, groups, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "check", "rules", rulesFile).CombinedOutput(); err != nil {
		t.Errorf("promtool check rules: %v\n%s", err, out)
	}
	// The alerts' unit tests, next to the plain rule file they name.
	tests, err := os.ReadFile(filepath.Join(root, "deploy", "prometheus", "ipmasq-rules.test.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	testsFile := filepath.Join(dir, "ipmasq-rules.test.yaml")
	if err := os.WriteFile(testsFile, tests, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "test", "rules", testsFile).CombinedOutput(); err != nil {
		t.Errorf("promtool test rules: %v\n%s", err, out)
	}
	alerts := map[string]bool{}
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			alerts[r.Alert] = true
			checkNames("alert "+r.Alert, r.Expr)
		}
	}
	for _, want := range []string{"IPMasqNATTableNearlyFull", "IPMasqDropsRising", "IPMasqConfigRejected", "IPMasqReconcilerErrors"} {
		if !alerts[want] {
			t.Errorf("%s: no alert %s", rulesFile, want)
		}
	}
	if rule.Kind != "PrometheusRule" {
		t.Errorf("ipmasq-rules.yaml is a %q, want a PrometheusRule", rule.Kind)
	}
}

// dashboardQueries returns every query of a Grafana dashboard (panels,
// rows' panels, template variables), by where it is.
func dashboardQueries(t *testing.T, path string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Title   string
		Targets []struct{ RefID, Expr string }
		Panels  json.RawMessage
	}
	var d struct {
		Panels     []panel
		Templating struct {
			List []struct{ Name, Type, Query string }
		}
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	out := map[string]string{}
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				out["panel "+p.Title+" "+tg.RefID] = tg.Expr
			}
			var nested []panel
			if len(p.Panels) > 0 && json.Unmarshal(p.Panels, &nested) == nil {
				walk(nested)
			}
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type == "query" {
			out["variable "+v.Name] = v.Query
		}
	}
	return out
}

// repoRoot is the module's directory.
func repoRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}
