package deploy_test

import (
	"testing"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// TestRunsOnLinuxNodesOnly: the DaemonSet `kubectl apply -k deploy/`
// creates selects Linux nodes (the image has only Linux binaries), and
// nothing else: every Linux node runs the agent.
func TestRunsOnLinuxNodesOnly(t *testing.T) {
	for _, m := range rendered(t, ".", kubetest.Kustomize(t, ".", "")) {
		if str(m.obj, "kind") != "DaemonSet" {
			continue
		}
		sel, _ := get(m.obj, "spec", "template", "spec", "nodeSelector").(map[string]any)
		if len(sel) != 1 || sel["kubernetes.io/os"] != "linux" {
			t.Errorf("%s: nodeSelector %v, want exactly kubernetes.io/os: linux", m, sel)
		}
		return
	}
	t.Fatal("kustomize deploy/ renders no DaemonSet")
}
