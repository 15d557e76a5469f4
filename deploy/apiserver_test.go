package deploy_test

import (
	"context"
	"path/filepath"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// TestManifestsAgainstAPIServer runs against one real kube-apiserver:
// every object the kustomizations render (`kubectl apply -k deploy/`, and
// deploy/uninstall/) and the example ConfigMap (deploy/config/) pass a
// server-side dry run (validation and admission, nothing stored); then,
// with rbac.yaml and the ServiceAccount applied, the agent's token can do
// exactly what the agent does (follow its Node, post Events on it) and
// nothing else.
func TestManifestsAgainstAPIServer(t *testing.T) {
	privtest.Require(t)
	s := kubetest.Start(t)
	admin := s.Client(kubetest.AdminToken)

	var objs []runtime.Object
	for _, dir := range kustomizations {
		for _, obj := range kubetest.DecodeYAML(t, "kustomize "+dir, kubetest.Kustomize(t, dir, "")) {
			if err := kubetest.Create(admin, obj, true); err != nil {
				t.Errorf("server-side dry run: kustomize %s: %v", dir, err)
			}
			objs = append(objs, obj)
		}
	}
	examples, err := filepath.Glob("config/*.yaml")
	if err != nil || len(examples) == 0 {
		t.Fatalf("no example ConfigMap in deploy/config/: %v", err)
	}
	for _, f := range examples {
		for _, obj := range kubetest.Decode(t, f) {
			if err := kubetest.Create(admin, obj, true); err != nil {
				t.Errorf("server-side dry run: %s: %v", f, err)
			}
		}
	}
	if t.Failed() {
		return
	}

	// The Job docs/deploy.md's loop makes for a node whose name is too
	// long to be part of a Job's name passes the API server's validation.
	t.Run("UninstallJobForLongNodeName", func(t *testing.T) {
		for _, obj := range kubetest.DecodeYAML(t, "uninstall for "+longNodeName, renderUninstallJob(t, longNodeName)) {
			if err := kubetest.Create(admin, obj, true); err != nil {
				t.Errorf("server-side dry run: %v", err)
			}
		}
	})

	t.Run("RBAC", func(t *testing.T) {
		for _, obj := range objs {
			switch obj.(type) {
			case *corev1.ServiceAccount, *rbacv1.ClusterRole, *rbacv1.ClusterRoleBinding:
				if err := kubetest.Create(admin, obj, false); err != nil {
					t.Fatal(err)
				}
			}
		}
		ctx := context.Background()
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}, Spec: corev1.NodeSpec{PodCIDRs: []string{"10.244.1.0/24"}}}
		if _, err := admin.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		agent := s.Client(kubetest.AgentToken)
		allowed(t, agent, ctx)
		forbidden(t, agent, ctx)
	})
}

// allowed: every call the agent makes succeeds with the agent's token.
func allowed(t *testing.T, c kubernetes.Interface, ctx context.Context) {
	t.Helper()
	if _, err := c.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{}); err != nil {
		t.Errorf("get Node: %v", err)
	}
	sel := fields.OneTermEqualSelector("metadata.name", "n1").String()
	list, err := c.CoreV1().Nodes().List(ctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil || len(list.Items) != 1 {
		t.Errorf("list Nodes (the informer's list): %v", err)
	}
	w, err := c.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		t.Errorf("watch Nodes (the informer's watch): %v", err)
	} else {
		w.Stop()
	}
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: "n1.", Namespace: metav1.NamespaceDefault},
		InvolvedObject: corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: "n1", UID: "n1"},
		Reason:         "IPMasqConfigRejected", Message: "test", Type: corev1.EventTypeWarning,
		Source: corev1.EventSource{Component: "ipmasq-agent", Host: "n1"},
	}
	created, err := c.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, ev, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create Event: %v", err)
	}
	if _, err := c.CoreV1().Events(metav1.NamespaceDefault).Patch(ctx, created.Name, types.StrategicMergePatchType,
		[]byte(`{"count":2}`), metav1.PatchOptions{}); err != nil {
		t.Errorf("patch Event: %v", err)
	}
}

// forbidden: anything beyond that is refused.
func forbidden(t *testing.T, c kubernetes.Interface, ctx context.Context) {
	t.Helper()
	calls := map[string]func() error{
		"update Node": func() error {
			n, err := c.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
			if err != nil {
				return err
			}
			n.Labels = map[string]string{"x": "y"}
			_, err = c.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
			return err
		},
		"patch Node": func() error {
			_, err := c.CoreV1().Nodes().Patch(ctx, "n1", types.StrategicMergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{})
			return err
		},
		"delete Node": func() error { return c.CoreV1().Nodes().Delete(ctx, "n1", metav1.DeleteOptions{}) },
		"list Events": func() error {
			_, err := c.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
			return err
		},
		"delete Events": func() error {
			return c.CoreV1().Events(metav1.NamespaceDefault).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		},
		"list Pods": func() error {
			_, err := c.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
			return err
		},
		"get Secrets": func() error {
			_, err := c.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{})
			return err
		},
		"get ConfigMaps": func() error {
			_, err := c.CoreV1().ConfigMaps("kube-system").List(ctx, metav1.ListOptions{})
			return err
		},
	}
	names := make([]string, 0, len(calls))
	for name := range calls {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if err := calls[name](); !apierrors.IsForbidden(err) {
			t.Errorf("%s with the agent's token: %v, want Forbidden", name, err)
		}
	}
}
