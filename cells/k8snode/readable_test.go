package k8snode_test

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/ipmasq/ipmasq/cells/k8snode"
	"github.com/ipmasq/ipmasq/cells/podcidrs"
	"github.com/ipmasq/ipmasq/internal/kubeclient"
	"github.com/ipmasq/ipmasq/readers/readiness"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// TestNodeReadability runs the Node's writer and the readiness reader
// against a real kube-apiserver, with the agent's own token: a read RBAC
// forbids, a Node that does not exist, the API server gone and back, and a
// Node deleted each make the node not ready, naming why; a Node that can be
// read makes it ready. Before table k8s-node, none of these was visible:
// with client-go's watch-list a failing list never reached the error
// handler, and a missing Node called no handler at all.
func TestNodeReadability(t *testing.T) {
	srv := kubetest.Start(t)
	admin := srv.Client(kubetest.AdminToken)
	agentREST := srv.Client(kubetest.AgentToken).(*kubernetes.Clientset).CoreV1().RESTClient()
	const node = "node-r1"

	var (
		db    *statedb.DB
		nodes statedb.Table[*tables.KubernetesNode]
		ready *readiness.Checker
	)
	// The agent's client, its connections made in the API server's
	// namespace (kubetest.Server.RESTConfig).
	startNodeWatch(t, &kubeclient.Client{CoreV1: agentREST, NodeName: node},
		readiness.Cell,
		cell.Invoke(func(d *statedb.DB, n statedb.Table[*tables.KubernetesNode], r *readiness.Checker) {
			db, nodes, ready = d, n, r
		}))

	// expect waits until the row has state and its error contains errText,
	// and readiness says the same (or ready, for NodeRead).
	expect := func(state tables.NodeReadState, errText string) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		var row *tables.KubernetesNode
		var conds []readiness.Condition
		for time.Now().Before(deadline) {
			row, _, _ = nodes.Get(db.ReadTxn(), tables.KubernetesNodeByName.Query(node))
			conds = ready.NotReady()
			if row != nil && row.State == state && strings.Contains(row.Error, errText) {
				if state == tables.NodeRead && len(conds) == 0 {
					return
				}
				if state != tables.NodeRead && len(conds) == 1 && conds[0].Name == readiness.ConditionNode &&
					strings.Contains(conds[0].Message, "Node "+node+": "+string(state)) {
					return
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatalf("want k8s-node %s (error containing %q) and readiness to match; have %+v, not ready: %v", state, errText, row, conds)
	}

	// No RBAC yet: the agent's token may not read Nodes.
	expect(tables.NodeReadFailed, "forbidden")

	// The ClusterRole of deploy/: allowed, but there is no such Node.
	kubetest.ApplyFiles(t, admin, "../../deploy/rbac.yaml")
	expect(tables.NodeNotFound, "not found")

	// The Node registers, with a pod CIDR: ready.
	ctx := context.Background()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}, Spec: corev1.NodeSpec{PodCIDR: "10.244.7.0/24", PodCIDRs: []string{"10.244.7.0/24"}}}
	if _, err := admin.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	expect(tables.NodeRead, "")

	// The API server goes away: not ready (the saved pod CIDRs stay in use),
	// and ready again once it is back.
	srv.Kill()
	expect(tables.NodeReadFailed, "")
	srv.Restart()
	expect(tables.NodeRead, "")

	// The Node is deleted: not ready.
	if err := admin.CoreV1().Nodes().Delete(ctx, node, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	expect(tables.NodeNotFound, "not found")
}

// startNodeWatch starts the Node's writer (k8snode.Cell and what it needs,
// a health scope per module as in the agent) with client, and extra cells;
// the hive stops when the test ends (Stop again is harmless).
func startNodeWatch(t *testing.T, client *kubeclient.Client, extra ...cell.Cell) (*hive.Hive, *slog.Logger) {
	t.Helper()
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = cell.ModuleDecorators{
		func(h cell.Health, id cell.ModuleID) cell.Health { return h.NewScope(string(id)) },
	}
	h := hive.NewWithOptions(opts, append([]cell.Cell{
		statedb.Cell, job.Cell, cell.SimpleHealthCell,
		settings.Cell,
		cell.Provide(func() *kubeclient.Client { return client }),
		podcidrs.Cell, k8snode.Cell,
	}, extra...)...)
	hive.AddConfigOverride(h, func(c *settings.Config) { c.StateDir = filepath.Join(t.TempDir(), "state") })
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return h, log
}
