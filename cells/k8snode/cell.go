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
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
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

	// Whether the Node can be read: the readiness reader's input.
	cell.ProvidePrivate(tables.NewKubernetesNodeTable),
	cell.Provide(statedb.RWTable[*tables.KubernetesNode].ToTable),
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
	Nodes    statedb.RWTable[*tables.KubernetesNode]
	Done     tables.KubernetesPodCIDRsDone
}

type watcher struct {
	log   *slog.Logger
	db    *statedb.DB
	tbl   statedb.RWTable[*tables.PodCIDR]
	nodes statedb.RWTable[*tables.KubernetesNode]
	// readMu orders the k8s-node writes of the event handlers and of the
	// first-sync check, which run on different goroutines.
	readMu sync.Mutex
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
		log: p.Log, db: p.DB, tbl: p.PodCIDRs, nodes: p.Nodes, done: p.Done, node: p.Client.NodeName,
		agent: p.Agent, saved: newSavedCIDRs(p.Agent.StateDir),
	}
	// Not read yet: the agent is not ready until the API server answers.
	w.setReadState(tables.NodeReading, nil)
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
	w.observeCalls(lw, client, health)
	inf := cache.NewSharedIndexInformer(lw, &corev1.Node{}, 0, cache.Indexers{})
	if err := inf.SetWatchErrorHandler(func(_ *cache.Reflector, err error) {
		w.readFailed(err, health)
	}); err != nil {
		return fmt.Errorf("watch error handler: %w", err)
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    w.onNode,
		UpdateFunc: func(_, obj any) { w.onNode(obj) },
		DeleteFunc: func(any) {
			w.readMu.Lock()
			defer w.readMu.Unlock()
			w.notFoundLocked(health)
		},
	}); err != nil {
		return fmt.Errorf("node event handler: %w", err)
	}
	go func() {
		// A list that finds no such Node calls no handler: after the
		// first successful list, an empty store is a Node that does not
		// exist (a wrong $K8S_NODE_NAME, a Node not registered yet).
		if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
			return
		}
		// The store holds the Node before its handler runs, and the
		// handler waits for readMu: no "read" is overwritten here.
		w.readMu.Lock()
		defer w.readMu.Unlock()
		if len(inf.GetStore().List()) == 0 {
			w.notFoundLocked(health)
		}
	}()
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		inf.RunWithContext(ctx)
	}()
	<-ctx.Done()
	// client-go's watch-list waits out its backoff (up to 30 s) without
	// looking at the context: an agent stopping while the API server is
	// unreachable would wait with it, and a pod past its grace period is
	// killed. The informer ends by itself after that wait; nothing it
	// does then reaches the tables (no call of the stopped context
	// succeeds).
	select {
	case <-stopped:
	case <-time.After(informerStopWait):
		w.log.Debug("Not waiting for the Node informer's backoff to end", "node", w.node)
	}
	return nil
}

// informerStopWait is how long a stopping agent waits for the Node
// informer to end.
const informerStopWait = 100 * time.Millisecond

// observeCalls makes every list and watch call of lw report its failure.
// The reflector's error handler is not enough: with client-go's
// WatchListClient (on by default) a watch-list that cannot reach the API
// server is retried inside the reflector, and the handler never hears of
// it, so an agent that never read its Node looked healthy.
func (w *watcher) observeCalls(lw *cache.ListWatch, client *kubeclient.Client, health cell.Health) {
	list, watchFn := lw.ListWithContextFunc, lw.WatchFuncWithContext
	lw.ListWithContextFunc = func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
		obj, err := list(ctx, o)
		w.callDone(ctx, client, err, health)
		return obj, err
	}
	lw.WatchFuncWithContext = func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
		wi, err := watchFn(ctx, o)
		w.callDone(ctx, client, err, health)
		return wi, err
	}
	// The reflector prefers the context variants; the others would bypass
	// the observation.
	lw.ListFunc = func(o metav1.ListOptions) (runtime.Object, error) {
		return lw.ListWithContextFunc(context.Background(), o)
	}
	lw.WatchFunc = func(o metav1.ListOptions) (watch.Interface, error) {
		return lw.WatchFuncWithContext(context.Background(), o)
	}
}

// callDone records a failed list or watch call. A resource version too
// old to watch from is routine (the reflector lists again), and so is the
// agent stopping. A call that succeeds after a failure asks for the Node
// once: a Node that was absent before the failure and still is calls no
// handler, and one that is back unchanged may not either.
func (w *watcher) callDone(ctx context.Context, client *kubeclient.Client, err error, health cell.Health) {
	if ctx.Err() != nil {
		return
	}
	if err == nil {
		if w.readState() == tables.NodeReadFailed {
			go w.reread(ctx, client, health)
		}
		return
	}
	if apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
		return
	}
	w.readFailed(err, health)
}

// reread gets the Node once, after the API server answered again.
func (w *watcher) reread(ctx context.Context, client *kubeclient.Client, health cell.Health) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var node corev1.Node
	err := client.CoreV1.Get().Resource("nodes").Name(w.node).Do(ctx).Into(&node)
	switch {
	case apierrors.IsNotFound(err):
		w.readMu.Lock()
		defer w.readMu.Unlock()
		w.notFoundLocked(health)
	case err == nil:
		w.onNode(&node)
	}
	// Any other error: the informer's next call reports it.
}

// readState is the k8s-node row's state.
func (w *watcher) readState() tables.NodeReadState {
	n, _, ok := w.nodes.Get(w.db.ReadTxn(), tables.KubernetesNodeByName.Query(w.node))
	if !ok {
		return ""
	}
	return n.State
}

// readFailed records that the Node could not be read.
func (w *watcher) readFailed(err error, health cell.Health) {
	w.readMu.Lock()
	changed := w.setReadState(tables.NodeReadFailed, err)
	w.readMu.Unlock()
	health.Degraded("watch Node "+w.node, err)
	if changed {
		w.log.Warn("Watching the Node failed; retrying, the last known pod CIDRs stay in use", "node", w.node, "error", err)
	}
}

// notFoundLocked records that the API server has no Node of the agent's
// name. readMu is held.
func (w *watcher) notFoundLocked(health cell.Health) {
	err := fmt.Errorf("Node %s not found: the API server has no Node of that name (--k8s-node-name, $%s)", w.node, kubeclient.NodeNameEnv)
	changed := w.setReadState(tables.NodeNotFound, err)
	health.Degraded("Node "+w.node+" not found", err)
	if !changed {
		return
	}
	w.log.Warn("The Node does not exist; the last known pod CIDRs stay in use", "node", w.node)
}

// setReadState writes the k8s-node row, and reports whether it changed.
func (w *watcher) setReadState(state tables.NodeReadState, err error) bool {
	row := &tables.KubernetesNode{Name: w.node, State: state}
	if err != nil {
		row.Error = err.Error()
	}
	wtxn := w.db.WriteTxn(w.nodes)
	defer wtxn.Commit()
	if old, _, ok := w.nodes.Get(wtxn, tables.KubernetesNodeByName.Query(w.node)); ok && *old == *row {
		return false
	}
	w.nodes.Insert(wtxn, row)
	return true
}

func (w *watcher) onNode(obj any) {
	node, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	w.readMu.Lock()
	w.setReadState(tables.NodeRead, nil)
	w.readMu.Unlock()
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
