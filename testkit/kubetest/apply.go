package kubetest

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
)

// ApplyFiles creates every object of the YAML files (documents separated by
// "---") in the API server.
func ApplyFiles(t testing.TB, c kubernetes.Interface, files ...string) {
	t.Helper()
	for _, f := range files {
		for _, obj := range Decode(t, f) {
			if err := Create(c, obj, false); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
		}
	}
}

// Decode reads the objects of a YAML file of Kubernetes manifests.
func Decode(t testing.TB, file string) []runtime.Object {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return decodeDocs(t, file, string(data))
}

func decodeDocs(t testing.TB, file, data string) []runtime.Object {
	t.Helper()
	var out []runtime.Object
	for i, doc := range strings.Split(data, "\n---\n") {
		if strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatalf("%s: document %d: %v", file, i+1, err)
		}
		out = append(out, obj)
	}
	return out
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// Create sends obj to the API server; with dryRun the server validates and
// admits it (server-side dry run) without storing it.
func Create(c kubernetes.Interface, obj runtime.Object, dryRun bool) error {
	ctx := context.Background()
	opts := metav1.CreateOptions{}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	var err error
	switch o := obj.(type) {
	case *corev1.ServiceAccount:
		_, err = c.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, opts)
	case *corev1.ConfigMap:
		_, err = c.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, opts)
	case *appsv1.DaemonSet:
		_, err = c.AppsV1().DaemonSets(o.Namespace).Create(ctx, o, opts)
	case *appsv1.Deployment:
		_, err = c.AppsV1().Deployments(o.Namespace).Create(ctx, o, opts)
	case *corev1.Service:
		_, err = c.CoreV1().Services(o.Namespace).Create(ctx, o, opts)
	case *batchv1.Job:
		_, err = c.BatchV1().Jobs(o.Namespace).Create(ctx, o, opts)
	case *rbacv1.ClusterRole:
		_, err = c.RbacV1().ClusterRoles().Create(ctx, o, opts)
	case *rbacv1.ClusterRoleBinding:
		_, err = c.RbacV1().ClusterRoleBindings().Create(ctx, o, opts)
	default:
		return fmt.Errorf("kubetest cannot create a %T; add it to kubetest.Create", obj)
	}
	if err != nil {
		return fmt.Errorf("create %T %s: %w", obj, name(obj), err)
	}
	return nil
}

func name(obj runtime.Object) string {
	if m, ok := obj.(metav1.Object); ok {
		return m.GetNamespace() + "/" + m.GetName()
	}
	return "?"
}
