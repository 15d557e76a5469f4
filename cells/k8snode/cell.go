// Package k8snode follows the agent's own Node in the API server (a
// client-go informer selecting it by name) and writes its spec.podCIDRs
// into the pod-cidrs table (origin "kubernetes"): they become the IPAM
// pools and the masquerade sources, and a change is followed live.
//
// The last ranges seen are kept in <state-dir>/node-pod-cidrs.json and
// written into the table before the API server is asked, so an agent that
// (re)starts while the API server is unreachable keeps its pools.
package k8snode

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"

	"github.com/ipmasq/ipmasq/internal/kubeclient"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell follows the Node. It needs kubeclient.Cell, podcidrs.Cell and the IPAM
// config (for --state-dir); without --k8s-node-name it does nothing.
var Cell = cell.Module(
	"k8s-node",
	"Pod CIDRs of the Node from the API server",

	cell.Invoke(register),
)

type params struct {
	cell.In

	Log      *slog.Logger
	DB       *statedb.DB
	Jobs     job.Registry
	Health   cell.Health
	Client   *kubeclient.Client
	Agent    settings.Config
	PodCIDRs statedb.RWTable[*tables.PodCIDR]
	Done     tables.KubernetesPodCIDRsDone
}

type watcher struct {
	log    *slog.Logger
	db     *statedb.DB
	tbl    statedb.RWTable[*tables.PodCIDR]
	done   tables.KubernetesPodCIDRsDone
	marked bool
	node   string
	agent  settings.Config
	saved  *savedCIDRs
	health cell.Health
}

func register(p params) error {
	if !p.Client.Enabled() {
		return nil
	}
	w := &watcher{
		log: p.Log, db: p.DB, tbl: p.PodCIDRs, done: p.Done, node: p.Client.NodeName,
		agent: p.Agent, saved: newSavedCIDRs(p.Agent.StateDir),
	}
	// Before anything asks the API server: the pools of the last run.
	prefixes, err := w.saved.load(w.node)
	switch {
	case err != nil:
		p.Log.Warn("Cannot use the saved pod CIDRs; waiting for the API server", "error", err)
	case len(prefixes) > 0:
		w.apply(prefixes)
		p.Log.Info("Pod CIDRs restored from disk until the API server answers", "node", w.node, "podCIDRs", prefixes, "file", w.saved.path)
	}
	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	g.Add(job.OneShot("watch-node", func(ctx context.Context, health cell.Health) error {
		return w.run(ctx, p.Client, health)
	}))
	return nil
}

// run watches the Node until the agent stops. client-go reconnects by
// itself (with backoff) when the API server goes away.
func (w *watcher) run(ctx context.Context, client *kubeclient.Client, health cell.Health) error {
	w.health = health
	// One informer on one Node, built from the core client alone (the
	// shared informer factory links every API group's informers).
	lw := cache.NewFilteredListWatchFromClient(client.CoreV1, "nodes", metav1.NamespaceAll,
		func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", w.node).String()
		})
	inf := cache.NewSharedIndexInformer(lw, &corev1.Node{}, 0, cache.Indexers{})
	if err := inf.SetWatchErrorHandler(func(_ *cache.Reflector, err error) {
		health.Degraded("watch Node "+w.node, err)
		w.log.Warn("Watching the Node failed; retrying, the last known pod CIDRs stay in use", "node", w.node, "error", err)
	}); err != nil {
		return fmt.Errorf("watch error handler: %w", err)
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    w.onNode,
		UpdateFunc: func(_, obj any) { w.onNode(obj) },
	}); err != nil {
		return fmt.Errorf("node event handler: %w", err)
	}
	inf.RunWithContext(ctx)
	return nil
}

func (w *watcher) onNode(obj any) {
	node, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	prefixes, err := w.podCIDRs(node)
	if err != nil {
		w.health.Degraded("Node "+w.node+" pod CIDRs", err)
		w.log.Warn("Ignoring the Node's pod CIDRs; the last known stay in use", "node", w.node, "error", err)
		return
	}
	if len(prefixes) == 0 {
		// Not allocated yet (or not by the controller manager): keep
		// what is known; the table is complete (the datapath masquerades
		// the --cluster-cidr sources) but the IPAM has no pool until then.
		w.apply(nil)
		w.health.Degraded("Node "+w.node+" pod CIDRs", fmt.Errorf("Node %s has no spec.podCIDRs of an enabled family", w.node))
		return
	}
	if w.apply(prefixes) {
		w.log.Info("Pod CIDRs from the Node", "node", w.node, "podCIDRs", prefixes)
	}
	if err := w.saved.store(w.node, prefixes); err != nil {
		w.health.Degraded("save the Node's pod CIDRs", err)
		w.log.Warn("Cannot save the Node's pod CIDRs; a restart during an API server outage would start without pools", "error", err)
		return
	}
	w.health.OK(fmt.Sprintf("Node %s: pod CIDRs %v", w.node, prefixes))
}

// podCIDRs are the Node's ranges of the enabled families.
func (w *watcher) podCIDRs(node *corev1.Node) ([]netip.Prefix, error) {
	cidrs := node.Spec.PodCIDRs
	if len(cidrs) == 0 && node.Spec.PodCIDR != "" {
		cidrs = []string{node.Spec.PodCIDR}
	}
	var out []netip.Prefix
	for i, s := range cidrs {
		p, err := netip.ParsePrefix(s)
		if err != nil || p.Masked() != p {
			return nil, fmt.Errorf("Node %s: spec.podCIDRs[%d]: %q is not a masked CIDR", w.node, i, s)
		}
		if (p.Addr().Is4() && w.agent.EnableIPv4) || (p.Addr().Is6() && w.agent.EnableIPv6) {
			out = append(out, p)
		}
	}
	if err := tables.ValidatePools(out); err != nil {
		return nil, fmt.Errorf("Node %s: spec.podCIDRs %s: %w", w.node, strings.Join(cidrs, ","), err)
	}
	// In the Node's order: the IPAM fills a family's pools in it.
	return out, nil
}

// apply writes the ranges (nil: keeps the known ones) and marks the table
// initialized the first time.
func (w *watcher) apply(prefixes []netip.Prefix) bool {
	wtxn := w.db.WriteTxn(w.tbl)
	changed := false
	if prefixes != nil {
		changed = tables.SetPodCIDRs(wtxn, w.tbl, tables.PodCIDRFromKubernetes, prefixes)
	}
	if !w.marked {
		w.done(wtxn)
		w.marked = true
	}
	wtxn.Commit()
	return changed
}
