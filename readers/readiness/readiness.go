// Package readiness says whether the node can do what the agent is there
// for, from the tables alone: a config is loaded (the non-masquerade set
// is the operator's, or the documented defaults), the masquerade programs
// are attached to every device they are meant for (a device left out
// sends pods' traffic unmasqueraded), there is a source to masquerade
// (with --masquerade-pod-cidrs-only, a pod CIDR is known), and, when the
// agent follows a Node, the Node can be read (the IPAM's pools come from
// its spec.podCIDRs: without them every CNI ADD fails).
//
// Ready is what a migration waits for before the old agent's chain goes:
// not ready, the node may still depend on it (docs/migrate.md).
//
// The metrics server answers /readyz from it (the DaemonSet's readiness
// probe: a rollout stops at the first node that is not ready), and the
// cell reports it as the health scope "readiness", so /healthz, the
// "health" command and `ipmasq-agent status` show it too. It is not
// liveness: none of these conditions is fixed by restarting the agent.
package readiness

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Names of the conditions.
const (
	// ConditionConfig: no config has been loaded since the agent started.
	ConditionConfig = "config"
	// ConditionDatapath: a selected device does not have the programs
	// attached, or no device is selected.
	ConditionDatapath = "datapath"
	// ConditionSources: no source is masqueraded (with
	// --masquerade-pod-cidrs-only: no pod CIDR is known).
	ConditionSources = "sources"
	// ConditionNode: the agent follows a Node it cannot read.
	ConditionNode = "node"
)

// Condition is one reason the node is not ready.
type Condition struct {
	// Name is one of the Condition* constants.
	Name string
	// Message says what is wrong and where to look.
	Message string
}

func (c Condition) String() string { return c.Name + ": " + c.Message }

// Checker evaluates the conditions. Every table is optional: a hive with
// a subset of the cells is judged on the parts it has.
type Checker struct {
	db       *statedb.DB
	config   statedb.Table[*tables.ConfigStatus]
	devices  statedb.Table[*tables.DatapathDevice]
	selected statedb.Table[*tables.EgressDevice]
	sources  statedb.Table[*tables.MasqueradeSource]
	nodes    statedb.Table[*tables.KubernetesNode]
	agent    settings.Config
}

type params struct {
	cell.In

	DB       *statedb.DB
	Agent    settings.Config                         `optional:"true"`
	Config   statedb.Table[*tables.ConfigStatus]     `optional:"true"`
	Devices  statedb.Table[*tables.DatapathDevice]   `optional:"true"`
	Selected statedb.Table[*tables.EgressDevice]     `optional:"true"`
	Sources  statedb.Table[*tables.MasqueradeSource] `optional:"true"`
	Nodes    statedb.Table[*tables.KubernetesNode]   `optional:"true"`
}

func newChecker(p params) *Checker {
	return &Checker{db: p.DB, config: p.Config, devices: p.Devices, selected: p.Selected, sources: p.Sources, nodes: p.Nodes, agent: p.Agent}
}

// NotReady returns the conditions that hold now (none: ready), in the
// order config, datapath, sources, node.
func (c *Checker) NotReady() []Condition {
	conds, _ := c.evaluate()
	return conds
}

// evaluate is NotReady with the watch channels of the tables it read (nil
// for an absent table): one closes when the conditions may have changed.
func (c *Checker) evaluate() ([]Condition, []<-chan struct{}) {
	txn := c.db.ReadTxn()
	var out []Condition
	var watches []<-chan struct{}
	if c.config != nil {
		rows, w := c.config.AllWatch(txn)
		watches = append(watches, w)
		if cond, ok := configCondition(statedb.Collect(rows)); ok {
			out = append(out, cond)
		}
	}
	if c.devices != nil {
		rows, w := c.devices.AllWatch(txn)
		watches = append(watches, w)
		var selected []*tables.EgressDevice
		if c.selected != nil {
			sel, w := c.selected.ListWatch(txn, tables.EgressDeviceBySelected.Query(true))
			watches = append(watches, w)
			selected = c.translatable(statedb.Collect(sel))
		}
		if cond, ok := datapathCondition(statedb.Collect(rows), selected); ok {
			out = append(out, cond)
		}
	}
	if c.sources != nil {
		rows, w := c.sources.AllWatch(txn)
		watches = append(watches, w)
		init, initWatch := c.sources.Initialized(txn)
		if !init {
			watches = append(watches, initWatch)
		}
		if cond, ok := sourcesCondition(init, statedb.Collect(rows)); ok {
			out = append(out, cond)
		}
	}
	if c.nodes != nil {
		rows, w := c.nodes.AllWatch(txn)
		watches = append(watches, w)
		if cond, ok := nodeCondition(statedb.Collect(rows)); ok {
			out = append(out, cond)
		}
	}
	return out, watches
}

// translatable keeps the selected devices the datapath attaches to: those
// with a masquerade address of an enabled family (without one there is
// nothing to translate to, and nothing to attach).
func (c *Checker) translatable(devs []*tables.EgressDevice) []*tables.EgressDevice {
	v4, v6 := c.agent.EnableIPv4, c.agent.EnableIPv6
	if !v4 && !v6 {
		// a hive without the settings: judge both families
		v4, v6 = true, true
	}
	var out []*tables.EgressDevice
	for _, d := range devs {
		if (v4 && d.SNATv4.IsValid()) || (v6 && d.SNATv6.IsValid()) {
			out = append(out, d)
		}
	}
	return out
}

func configCondition(rows []*tables.ConfigStatus) (Condition, bool) {
	for _, r := range rows {
		if r.Origin != tables.ConfigOriginNone {
			return Condition{}, false
		}
	}
	msg := "no config loaded yet"
	if len(rows) > 0 {
		r := rows[0]
		msg = "no config loaded yet from " + r.Path
		if r.LastError != "" {
			msg += ": " + r.LastError
		}
	}
	return Condition{Name: ConditionConfig, Message: msg + "; the non-masquerade set is unknown and the IPAM answers no allocation"}, true
}

// datapathCondition holds unless the programs are attached to every
// datapath device, and every selected device with a masquerade address
// (selected; nil when unknown) is one of them: a device left out would
// send the pods' traffic through it unmasqueraded.
func datapathCondition(rows []*tables.DatapathDevice, selected []*tables.EgressDevice) (Condition, bool) {
	var notAttached []string
	have := make(map[int]bool, len(rows))
	for _, d := range rows {
		have[d.Index] = true
		switch d.Status.Kind {
		case reconciler.StatusKindDone:
		case reconciler.StatusKindError:
			notAttached = append(notAttached, d.Name+" ("+d.Status.GetError()+")")
		default:
			notAttached = append(notAttached, d.Name+" (pending)")
		}
	}
	for _, d := range selected {
		if !have[d.Index] {
			notAttached = append(notAttached, d.Name+" (pending)")
		}
	}
	if len(rows) == 0 && len(notAttached) == 0 {
		return Condition{Name: ConditionDatapath, Message: "no egress device is selected (--devices, or no device with a route and an address): nothing is masqueraded"}, true
	}
	if len(notAttached) == 0 {
		return Condition{}, false
	}
	slices.Sort(notAttached)
	return Condition{Name: ConditionDatapath, Message: "the masquerade programs are not attached to every selected device, traffic leaving through these is not masqueraded: " +
		strings.Join(notAttached, ", ")}, true
}

// sourcesCondition holds while nothing is masqueraded for want of a
// source: the table not derived yet, or no entry that masquerades (only
// --masquerade-pod-cidrs-only leaves none: by default 0.0.0.0/0 and ::/0
// are).
func sourcesCondition(initialized bool, rows []*tables.MasqueradeSource) (Condition, bool) {
	if !initialized {
		return Condition{Name: ConditionSources, Message: "the masquerade sources are not known yet (with --masquerade-pod-cidrs-only: waiting for the pod CIDRs)"}, true
	}
	for _, r := range rows {
		if r.Masquerade {
			return Condition{}, false
		}
	}
	return Condition{Name: ConditionSources, Message: "no source is masqueraded: --masquerade-pod-cidrs-only and no pod CIDR is known " +
		"(--pod-cidr, --cluster-cidr or the Node's spec.podCIDRs); pods' traffic leaves unmasqueraded"}, true
}

func nodeCondition(rows []*tables.KubernetesNode) (Condition, bool) {
	var bad []string
	for _, n := range rows {
		if n.Readable() {
			continue
		}
		s := fmt.Sprintf("Node %s: %s", n.Name, n.State)
		if n.Error != "" {
			s += ": " + n.Error
		}
		bad = append(bad, s)
	}
	if len(bad) == 0 {
		return Condition{}, false
	}
	return Condition{Name: ConditionNode, Message: "cannot read the agent's Node, where the IPAM's pools come from (CNI ADD fails while no pod CIDR is known): " + strings.Join(bad, "; ")}, true
}

// Cell provides the *Checker and reports readiness as a health scope.
var Cell = cell.Module(
	"readiness",
	"Whether the node can do its job",

	cell.Provide(newChecker),
	cell.Invoke(registerReporter),
)

func registerReporter(c *Checker, jobs job.Registry, health cell.Health, log *slog.Logger) {
	g := jobs.NewGroup(health, job.WithLogger(log))
	g.Add(job.OneShot("report", func(ctx context.Context, health cell.Health) error {
		return report(ctx, c, health, log)
	}))
}

// report keeps the health scope in step with the conditions, logging each
// change once.
func report(ctx context.Context, c *Checker, health cell.Health, log *slog.Logger) error {
	last := "unset"
	for {
		conds, w := c.evaluate()
		text := joined(conds)
		if text != last {
			if len(conds) == 0 {
				health.OK("ready")
				log.Info("Ready")
			} else {
				// One line: "config: ...; datapath: ...".
				health.Degraded("not ready", errors.New(text))
				log.Info("Not ready", "conditions", text)
			}
			last = text
		}
		if !waitAny(ctx, w) {
			return nil
		}
	}
}

// waitAny waits until one of the channels closes (true) or ctx is done
// (false). nil channels never close.
func waitAny(ctx context.Context, chans []<-chan struct{}) bool {
	cases := make([]reflect.SelectCase, 0, len(chans)+1)
	cases = append(cases, reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(ctx.Done())})
	for _, ch := range chans {
		if ch != nil {
			cases = append(cases, reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(ch)})
		}
	}
	chosen, _, _ := reflect.Select(cases)
	return chosen != 0
}

func joined(conds []Condition) string {
	s := make([]string, len(conds))
	for i, c := range conds {
		s[i] = c.String()
	}
	return strings.Join(s, "; ")
}
