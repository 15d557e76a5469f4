package nodee2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// ipmasqOnNode lists what of ipmasq the node holds: its pins, the programs
// attached to the node's devices, its ip rules (protocol 170) and its
// files.
func (c *cluster) ipmasqOnNode() []string {
	var found []string
	if entries, err := os.ReadDir(c.node.Root("/sys/fs/bpf/ipmasq")); err == nil {
		found = append(found, fmt.Sprintf("pin directory /sys/fs/bpf/ipmasq with %d entries", len(entries)))
	}
	// Nothing but ipmasq attaches tc programs in the node (ptp does not).
	links, err := c.nodeNetns.NL.LinkList()
	if err != nil {
		c.t.Fatal(err)
	}
	for _, l := range links {
		for _, at := range []ebpf.AttachType{ebpf.AttachTCXEgress, ebpf.AttachTCXIngress} {
			var res *link.QueryResult
			if err := c.nodeNetns.Do(func() (err error) {
				res, err = link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: at})
				return err
			}); err != nil {
				c.t.Fatalf("query tcx programs of %s: %v", l.Attrs().Name, err)
			}
			for _, p := range res.Programs {
				found = append(found, fmt.Sprintf("program %d attached to %s (%s)", p.ID, l.Attrs().Name, at))
			}
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_EGRESS, netlink.HANDLE_MIN_INGRESS} {
			filters, _ := c.nodeNetns.NL.FilterList(l, parent)
			for _, f := range filters {
				found = append(found, fmt.Sprintf("program in a tc filter on %s: %+v", l.Attrs().Name, f.Attrs()))
			}
		}
	}
	for _, fam := range []string{"-4", "-6"} {
		for _, l := range strings.Split(c.node.MustRun("ip", fam, "rule", "show"), "\n") {
			if strings.Contains(l, "proto 170") {
				found = append(found, "rule "+strings.TrimSpace(l))
			}
		}
	}
	for _, f := range []string{cniConfigPath, "/opt/cni/bin/ipmasq-cni"} {
		if _, err := os.Lstat(c.node.Root(f)); err == nil {
			found = append(found, "file "+f)
		}
	}
	for _, d := range []string{"/var/lib/ipmasq", "/run/ipmasq"} {
		entries, _ := os.ReadDir(c.node.Root(d))
		for _, e := range entries {
			found = append(found, "file "+d+"/"+e.Name())
		}
	}
	return found
}

// testUninstall removes ipmasq as docs/deploy.md says: the pods on its
// network first (their CNI DEL needs the agent), the CNI config and
// plugin, kubectl delete -k deploy/, then the uninstall Job on the node, and checks the node holds
// nothing of ipmasq afterwards.
func testUninstall(t *testing.T, c *cluster, image string) {
	before := c.ipmasqOnNode()
	for _, want := range []string{"pin directory", "program", "rule", "file"} {
		if !strings.Contains(strings.Join(before, "\n"), want) {
			t.Fatalf("before the uninstall the node holds no %s of ipmasq: %v", want, before)
		}
	}
	pods, err := c.admin.CoreV1().Pods("default").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		c.deletePod("default", p.Name)
	}
	// The host step's files (docs/deploy.md, "The CNI plugin").
	for _, f := range []string{cniConfigPath, "/opt/cni/bin/ipmasq-cni"} {
		if err := os.Remove(c.node.Root(f)); err != nil {
			t.Fatal(err)
		}
	}
	c.uninstallAgent(image)
	if left := c.ipmasqOnNode(); len(left) > 0 {
		t.Errorf("after the uninstall the node still holds:\n%s", strings.Join(left, "\n"))
	}
}

// uninstallAgent is docs/deploy.md's uninstall after the pods and the
// CNI files: kubectl delete -k deploy/, then the uninstall Job on the node.
func (c *cluster) uninstallAgent(image string) {
	t := c.t
	begin := time.Now()
	c.deleteRendered("../../deploy", image)
	// docs/deploy.md's loop: the node's name, and 16 hex digits of its
	// SHA-256 in the Job's name.
	sum := sha256.Sum256([]byte(nodeName))
	jobName := "ipmasq-uninstall-" + hex.EncodeToString(sum[:])[:16]
	c.apply("../../deploy/uninstall", image, func(b []byte) []byte {
		b = bytes.ReplaceAll(b, []byte("replace-with-node-name"), []byte(nodeName))
		return bytes.ReplaceAll(b, []byte("ipmasq-uninstall-replace-with-node-id"), []byte(jobName))
	})
	jobs := c.admin.BatchV1().Jobs("kube-system")
	c.eventually(3*time.Minute, "the uninstall Job complete", func() error {
		j, err := jobs.Get(context.Background(), jobName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if j.Status.Succeeded == 0 {
			return fmt.Errorf("succeeded %d, failed %d", j.Status.Succeeded, j.Status.Failed)
		}
		return nil
	})
	t.Logf("uninstalled in %v (the Job retries while the agent's pod stops)", time.Since(begin).Round(time.Millisecond))
}

// deleteRendered deletes the objects of a kustomization as `kubectl delete
// -k` does (the garbage collector deletes the DaemonSet's pods).
func (c *cluster) deleteRendered(dir, image string) {
	t := c.t
	ctx := context.Background()
	for _, obj := range kubetest.DecodeYAML(t, "kustomize "+dir, kubetest.Kustomize(t, dir, image)) {
		var err error
		switch o := obj.(type) {
		case *appsv1.DaemonSet:
			err = c.admin.AppsV1().DaemonSets(o.Namespace).Delete(ctx, o.Name, metav1.DeleteOptions{})
		case *corev1.ConfigMap:
			err = c.admin.CoreV1().ConfigMaps(o.Namespace).Delete(ctx, o.Name, metav1.DeleteOptions{})
		case *corev1.ServiceAccount:
			err = c.admin.CoreV1().ServiceAccounts(o.Namespace).Delete(ctx, o.Name, metav1.DeleteOptions{})
		case *rbacv1.ClusterRole:
			err = c.admin.RbacV1().ClusterRoles().Delete(ctx, o.Name, metav1.DeleteOptions{})
		case *rbacv1.ClusterRoleBinding:
			err = c.admin.RbacV1().ClusterRoleBindings().Delete(ctx, o.Name, metav1.DeleteOptions{})
		default:
			t.Fatalf("kustomize %s: cannot delete a %T", dir, obj)
		}
		if err != nil {
			t.Fatalf("kustomize %s: delete %T: %v", dir, obj, err)
		}
	}
}
