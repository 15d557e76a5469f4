package ipmasq_test

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestAgentLinksOnlyTheKubernetesTypesItUses: the agent reads its Node and
// posts Events, so of the Kubernetes API types it links the core group
// only. client-go's clientset, its informer factory or its scheme link every
// API group (types, clients, informers, listers): the binary went from
// 43 MB to 95 MB, and the pages its package initialisation touches were
// most of the agent's RSS (issue #14: 24 against 42 MiB before any work).
func TestAgentLinksOnlyTheKubernetesTypesItUses(t *testing.T) {
	goTool := filepath.Join(runtime.GOROOT(), "bin", "go")
	out, err := exec.Command(goTool, "list", "-deps", "./cmd/ipmasq-agent").Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/ipmasq-agent: %v", err)
	}
	allowedAPI := map[string]bool{"k8s.io/api/core/v1": true}
	forbidden := []string{
		"k8s.io/client-go/kubernetes",          // the clientset, its scheme and typed clients
		"k8s.io/client-go/informers",           // every group's informers
		"k8s.io/client-go/listers",             // every group's listers
		"k8s.io/client-go/applyconfigurations", // every group's apply configurations
	}
	deps := strings.Fields(string(out))
	if len(deps) < 50 {
		t.Fatalf("go list -deps found only %d packages", len(deps))
	}
	for _, dep := range deps {
		if strings.HasPrefix(dep, "k8s.io/api/") && !allowedAPI[dep] {
			t.Errorf("ipmasq-agent links %s: only the core group's types are needed (see internal/kubeclient)", dep)
		}
		for _, f := range forbidden {
			if dep == f || strings.HasPrefix(dep, f+"/") {
				t.Errorf("ipmasq-agent links %s, which brings every API group with it (see internal/kubeclient)", dep)
			}
		}
	}
}
