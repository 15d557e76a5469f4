// Package readiness says whether the node can do what the agent is there
// for, from the tables alone: a config is loaded (the non-masquerade set
// is the operator's, or the documented defaults), the masquerade programs
// are attached to at least one of the devices they are meant for, and,
// when the agent follows a Node, the Node can be read (the IPAM's pools
// come from its spec.podCIDRs: without them every CNI ADD fails).
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
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// Names of the conditions.
const (
	// ConditionConfig: no config has been loaded since the agent started.
	ConditionConfig = "config"
	// ConditionDatapath: the programs are attached to none of the
	// datapath's devices.
	ConditionDatapath = "datapath"
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
	db      *statedb.DB
	config  statedb.Table[*tables.ConfigStatus]
	devices statedb.Table[*tables.DatapathDevice]
	nodes   statedb.Table[*tables.KubernetesNode]
}

type params struct {
	cell.In

	DB      *statedb.DB
	Config  statedb.Table[*tables.ConfigStatus]   `optional:"true"`
	Devices statedb.Table[*tables.DatapathDevice] `optional:"true"`
	Nodes   statedb.Table[*tables.KubernetesNode] `optional:"true"`
}

func newChecker(p params) *Checker {
	return &Checker{db: p.DB, config: p.Config, devices: p.Devices, nodes: p.Nodes}
}

// NotReady returns the conditions that hold now (none: ready), in the
// order config, datapath, node.
func (c *Checker) NotReady() []Condition {
	conds, _ := c.evaluate()
	return conds
}

// evaluate is NotReady with the watch channels of the tables it read (at
// most three, nil for an absent table): one closes when the conditions may
// have changed.
func (c *Checker) evaluate() ([]Condition, [3]<-chan struct{}) {
	txn := c.db.ReadTxn()
	var out []Condition
	var watches [3]<-chan struct{}
	if c.config != nil {
		rows, w := c.config.AllWatch(txn)
		watches[0] = w
		if cond, ok := configCondition(statedb.Collect(rows)); ok {
			out = append(out, cond)
		}
	}
	if c.devices != nil {
		rows, w := c.devices.AllWatch(txn)
		watches[1] = w
		if cond, ok := datapathCondition(statedb.Collect(rows)); ok {
			out = append(out, cond)
		}
	}
	if c.nodes != nil {
		rows, w := c.nodes.AllWatch(txn)
		watches[2] = w
		if cond, ok := nodeCondition(statedb.Collect(rows)); ok {
			out = append(out, cond)
		}
	}
	return out, watches
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

func datapathCondition(rows []*tables.DatapathDevice) (Condition, bool) {
	var notAttached []string
	for _, d := range rows {
		switch d.Status.Kind {
		case reconciler.StatusKindDone:
			return Condition{}, false
		case reconciler.StatusKindError:
			notAttached = append(notAttached, d.Name+" ("+d.Status.GetError()+")")
		default:
			notAttached = append(notAttached, d.Name+" (pending)")
		}
	}
	if len(rows) == 0 {
		return Condition{Name: ConditionDatapath, Message: "no egress device is selected (--devices, or no device with a default route and an address): nothing is masqueraded"}, true
	}
	slices.Sort(notAttached)
	return Condition{Name: ConditionDatapath, Message: "the masquerade programs are attached to none of the selected devices: " + strings.Join(notAttached, ", ")}, true
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
		select {
		case <-ctx.Done():
			return nil
		case <-w[0]:
		case <-w[1]:
		case <-w[2]:
		}
	}
}

func joined(conds []Condition) string {
	s := make([]string, len(conds))
	for i, c := range conds {
		s[i] = c.String()
	}
	return strings.Join(s, "; ")
}
