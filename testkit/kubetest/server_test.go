package kubetest

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// TestServer starts the API server, creates a Node as admin, and checks
// that the agent's token has no permission before RBAC grants one, and
// that a restart keeps the stored objects.
func TestServer(t *testing.T) {
	privtest.Require(t)
	s := Start(t)
	ctx := context.Background()
	admin := s.Client(AdminToken)
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}, Spec: corev1.NodeSpec{PodCIDRs: []string{"10.244.1.0/24"}}}
	if _, err := admin.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create node: %v", err)
	}
	_, err := s.Client(AgentToken).CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
	if !apierrors.IsForbidden(err) {
		t.Fatalf("agent token without RBAC: get node: got %v, want forbidden", err)
	}
	s.Kill()
	s.Restart()
	got, err := admin.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get node after restart: %v", err)
	}
	if len(got.Spec.PodCIDRs) != 1 || got.Spec.PodCIDRs[0] != "10.244.1.0/24" {
		t.Fatalf("node after restart: podCIDRs %v", got.Spec.PodCIDRs)
	}
}
