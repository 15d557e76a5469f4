package metrics

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// registeredNames are the ipmasq_* metrics the cell registers in a hive
// that has every source it reads, sorted.
func registeredNames(t *testing.T) []string {
	t.Helper()
	var reg *prometheus.Registry
	h := hive.New(statedb.Cell, job.Cell, cell.SimpleHealthCell,
		cell.Provide(
			func() settings.Config { return settings.Config{BPFRoot: t.TempDir(), MaxNonMasqCIDRs: 16} },
			func() tables.DatapathVariant {
				return tables.DatapathVariant{Variant: "full", Reason: "test", AttachMode: "auto"}
			},
			tableOf(tables.NewConfigStatusTable),
			tableOf(tables.NewEndpointTable),
			tableOf(tables.NewIPRuleTable),
			tableOf(tables.NewNonMasqCIDRTable),
			tableOf(tables.NewDatapathDeviceTable),
			tableOf(tables.NewEgressDeviceTable),
			tableOf(tables.NewMasqueradeRuleSourceTable),
			tableOf(tables.NewNetfilterNATRuleTable),
		),
		cell.Module("metrics", "The metrics registration",
			registration,
			cell.Invoke(func(r *prometheus.Registry, _ reconciler.Metrics) { reg = r })),
	)
	if err := h.Populate(hivetest.Logger(t)); err != nil {
		t.Fatal(err)
	}
	ch := make(chan *prometheus.Desc)
	go func() { reg.Describe(ch); close(ch) }()
	fqName := regexp.MustCompile(`fqName: "(ipmasq_[a-z0-9_]+)"`)
	var names []string
	for d := range ch {
		if m := fqName.FindStringSubmatch(d.String()); m != nil {
			names = append(names, m[1])
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// tableOf provides a table a metric reads, as its writer would.
func tableOf[Obj any](newTable func(*statedb.DB) (statedb.RWTable[Obj], error)) func(*statedb.DB) (statedb.Table[Obj], error) {
	return func(db *statedb.DB) (statedb.Table[Obj], error) { return newTable(db) }
}

var metricName = regexp.MustCompile(`ipmasq_[a-z0-9_]*[a-z0-9]`)

// TestMetricListsMatchTheRegistry: the package doc's list of metrics names
// exactly the metrics the cell registers, and docs/observability.md names
// every one of them and no other.
func TestMetricListsMatchTheRegistry(t *testing.T) {
	code := registeredNames(t)
	if len(code) < 20 {
		t.Fatalf("only %d metrics registered: %v", len(code), code)
	}

	src, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	var doc []string
	for line := range strings.Lines(string(src)) {
		if rest, ok := strings.CutPrefix(line, "//\tipmasq_"); ok {
			doc = append(doc, metricName.FindString("ipmasq_"+rest))
		}
	}
	slices.Sort(doc)
	if !slices.Equal(doc, code) {
		t.Errorf("readers/metrics/doc.go lists\n\t%s\nthe cell registers\n\t%s", doc, code)
	}

	md, err := os.ReadFile("../../docs/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	named := map[string]bool{}
	for _, at := range metricName.FindAllStringIndex(string(md), -1) {
		name := string(md[at[0]:at[1]])
		if at[1] < len(md) && md[at[1]] == '_' {
			continue // a prefix in a pattern: ipmasq_nat_(entries|capacity)
		}
		named[name] = true
		if !slices.Contains(code, name) {
			t.Errorf("docs/observability.md names %s, which the cell does not register", name)
		}
	}
	for _, name := range code {
		if !named[name] {
			t.Errorf("docs/observability.md does not name %s", name)
		}
	}
}
