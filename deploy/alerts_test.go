package deploy_test

import (
	"os"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/ipmasq/ipmasq/bpf"
)

// alertAnnotations returns the annotations of alert name in
// prometheus/ipmasq-rules.yaml.
func alertAnnotations(t *testing.T, name string) map[string]any {
	t.Helper()
	data, err := os.ReadFile("prometheus/ipmasq-rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rule object
	if err := yaml.Unmarshal(data, &rule); err != nil {
		t.Fatal(err)
	}
	spec, _ := rule["spec"].(object)
	groups, _ := spec["groups"].([]any)
	for _, g := range groups {
		rules, _ := g.(object)["rules"].([]any)
		for _, r := range rules {
			if r := r.(object); r["alert"] == name {
				a, _ := r["annotations"].(object)
				return a
			}
		}
	}
	t.Fatalf("prometheus/ipmasq-rules.yaml: no alert %s", name)
	return nil
}

// TestNATFullAlertSaysWhatTheDatapathDoes: the NAT maps are hashes with
// early drop, not LRU maps: when one is full a new flow takes the place of
// a pair that is not assured, or is refused (drop reason nat-table-full)
// when every pair is, and no established flow is evicted for it
// (docs/datapath.md, Connections). The alert that fires before that says
// so, not what the LRU maps did.
func TestNATFullAlertSaysWhatTheDatapathDoes(t *testing.T) {
	desc, _ := alertAnnotations(t, "IPMasqNATTableNearlyFull")["description"].(string)
	for _, stale := range []string{"least recently used", "flows evict", "established flows included"} {
		if strings.Contains(desc, stale) {
			t.Errorf("IPMasqNATTableNearlyFull's description says %q (LRU maps): %q", stale, desc)
		}
	}
	for _, want := range []string{"refused", bpf.DropNATFull.String()} {
		if !strings.Contains(desc, want) {
			t.Errorf("IPMasqNATTableNearlyFull's description does not say %q: %q", want, desc)
		}
	}
}
