// Package nodeevents posts Events on the agent's Node for what an operator
// must act on. The config file's state: it reads the ipmasq-config table
// and posts an Event when a file is rejected (reason IPMasqConfigRejected,
// the error naming file, key and value), once per distinct error, and when
// a good file follows a rejected one (IPMasqConfigAccepted); and when the
// applied config has warnings (IPMasqConfigWarnings: unknown keys ignored,
// with the key likely meant; merged files that disagree), once per
// distinct set, and when they are gone (IPMasqConfigWarningsCleared). Conditions
// (conditions.go): a device the programs could not be attached to
// (IPMasqDeviceNotAttached, from table datapath-devices), a netfilter NAT
// rule deciding before the programs (IPMasqNetfilterDecidesFirst, from table
// netfilter-nat-rules), new flows refused
// because the NAT table is full or no NAT port is free (IPMasqNATTableFull,
// IPMasqNATPortsExhausted, from the pinned per-device counters), and any
// source another cell adds through SourceOut; each is posted when it
// appears, when its message changes (at most every MinRepeat), and when it
// clears. It is a reader: it writes no table, and without --k8s-node-name
// it does nothing.
package nodeevents

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/internal/kubeclient"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Reasons of the Events posted on the Node.
const (
	ReasonRejected = "IPMasqConfigRejected"
	ReasonAccepted = "IPMasqConfigAccepted"
	// ReasonWarnings: the applied config has warnings (unknown keys
	// ignored, merged files that disagree); ReasonWarningsCleared: no
	// longer.
	ReasonWarnings        = "IPMasqConfigWarnings"
	ReasonWarningsCleared = "IPMasqConfigWarningsCleared"
)

// Component is the Events' source component.
const Component = "ipmasq-agent"

// eventNamespace is where Events about cluster-scoped objects such as
// Nodes live (the kubelet posts its Node events there too).
const eventNamespace = metav1.NamespaceDefault

// maxMessage is the API server's limit on an Event's message.
const maxMessage = 1024

// Cell posts the config and condition Events. It needs kubeclient.Cell and
// the config cell; the datapath's tables and pins are optional.
var Cell = cell.Module(
	"node-events",
	"Config rejections and datapath trouble as Events on the Node",

	cell.Invoke(register),
)

// refusalPoll is how often the datapath's refusal counters are read.
const refusalPoll = 10 * time.Second

// refusalClear is how long without a refused flow clears the condition.
const refusalClear = 5 * time.Minute

type params struct {
	cell.In

	Log    *slog.Logger
	DB     *statedb.DB
	Jobs   job.Registry
	Health cell.Health
	Client *kubeclient.Client
	Status statedb.Table[*tables.ConfigStatus]

	Agent     settings.Config                         `optional:"true"`
	Devices   statedb.Table[*tables.DatapathDevice]   `optional:"true"`
	Netfilter statedb.Table[*tables.NetfilterNATRule] `optional:"true"`
	Sources   []ConditionSource                       `group:"node-conditions"`
}

func register(p params) {
	if !p.Client.Enabled() {
		return
	}
	post := &poster{log: p.Log, client: p.Client}
	r := &reporter{poster: post, db: p.DB, status: p.Status}
	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	g.Add(job.OneShot("post-config-events", r.run))

	sources := slices.DeleteFunc(slices.Clone(p.Sources), func(s ConditionSource) bool { return s == nil })
	if p.Devices != nil {
		sources = append(sources, FromTable(p.Devices, AttachCondition))
	}
	if p.Netfilter != nil {
		sources = append(sources, FromTable(p.Netfilter, NetfilterCondition))
	}
	if p.Agent.BPFRoot != "" {
		pinned := bpf.Pinned{Dir: p.Agent.PinDir()}
		sources = append(sources, &refusalSource{read: pinned.DevCounters, capacity: pinned.NATFill,
			interval: refusalPoll, clearAfter: refusalClear, now: time.Now})
	}
	if len(sources) > 0 {
		c := &conditionReporter{poster: post, db: p.DB, sources: sources}
		g.Add(job.OneShot("post-condition-events", c.run))
	}
}

// Event is what the reporter posts: a reason, a type and a message.
type Event struct {
	Type, Reason, Message string
}

// decider turns config states into Events: one per distinct rejection,
// one when a good file replaces a rejected one, one per distinct set of
// warnings of the applied config and one when they are gone.
type decider struct {
	// reported is the rejection last posted; empty when none is
	// outstanding.
	reported string
	// warned is the warnings message last posted; empty when none is
	// outstanding.
	warned string
}

// next is the Event the state st calls for, or nil. It does not change the
// decider: call posted once the Event is in the API server, so that a
// failed post is tried again.
func (d *decider) next(st *tables.ConfigStatus) *Event {
	switch {
	case st.LastError != "" && st.LastError != d.reported:
		return &Event{Type: corev1.EventTypeWarning, Reason: ReasonRejected, Message: st.LastError}
	case st.LastError == "" && d.reported != "":
		return &Event{Type: corev1.EventTypeNormal, Reason: ReasonAccepted,
			Message: fmt.Sprintf("%s: accepted (generation %d); the rejected content is replaced", st.Path, st.Generation)}
	}
	if w := warningsMessage(st); w != d.warned {
		if w == "" {
			return &Event{Type: corev1.EventTypeNormal, Reason: ReasonWarningsCleared,
				Message: fmt.Sprintf("%s: the applied config (generation %d) has no warnings", st.Path, st.Generation)}
		}
		return &Event{Type: corev1.EventTypeWarning, Reason: ReasonWarnings, Message: w}
	}
	return nil
}

// warningsMessage is the Event message of st's warnings; "" when none.
func warningsMessage(st *tables.ConfigStatus) string {
	if len(st.Warnings) == 0 {
		return ""
	}
	return fmt.Sprintf("%d config warning(s), the rest of the config is applied: %s",
		len(st.Warnings), strings.Join(st.WarningMessages(), "; "))
}

// posted records that e was posted.
func (d *decider) posted(e *Event) {
	switch e.Reason {
	case ReasonRejected:
		d.reported = e.Message
	case ReasonAccepted:
		d.reported = ""
	case ReasonWarnings:
		d.warned = e.Message
	case ReasonWarningsCleared:
		d.warned = ""
	}
}

type reporter struct {
	poster *poster
	db     *statedb.DB
	status statedb.Table[*tables.ConfigStatus]
	d      decider
}

// run follows the ipmasq-config table. A post that fails (API server
// unreachable) is retried every few seconds; meanwhile newer states replace
// the pending Event, so what is posted in the end is the current state.
func (r *reporter) run(ctx context.Context, health cell.Health) error {
	const retry = 2 * time.Second
	for {
		var retryC <-chan time.Time
		iter, watch := r.status.AllWatch(r.db.ReadTxn())
		for st := range iter {
			// A state may call for several Events (a rejected file
			// beside merged ones with warnings): each is posted in turn.
			for e := r.d.next(st); e != nil; e = r.d.next(st) {
				if err := r.poster.post(ctx, e); err != nil {
					health.Degraded("post Event "+e.Reason+" on Node "+r.poster.client.NodeName, err)
					retryC = time.After(retry)
					break
				}
				r.d.posted(e)
				health.OK("posted " + e.Reason)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case <-retryC:
		}
	}
}

// poster creates Events on the agent's Node.
type poster struct {
	log    *slog.Logger
	client *kubeclient.Client
}

func (r *poster) post(ctx context.Context, e *Event) error {
	node := r.client.NodeName
	msg := e.Message
	if len(msg) > maxMessage {
		msg = msg[:maxMessage-3] + "..."
	}
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{GenerateName: node + ".", Namespace: eventNamespace},
		// The kubelet uses the node name as the UID of its Node events;
		// doing the same groups them in kubectl describe node.
		InvolvedObject:      corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: node, UID: types.UID(node)},
		Type:                e.Type,
		Reason:              e.Reason,
		Message:             msg,
		Source:              corev1.EventSource{Component: Component, Host: node},
		FirstTimestamp:      now,
		LastTimestamp:       now,
		Count:               1,
		ReportingController: Component,
		ReportingInstance:   Component + "-" + node,
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := r.client.CoreV1.Post().Namespace(eventNamespace).Resource("events").Body(ev).Do(ctx).Error(); err != nil {
		return fmt.Errorf("create Event: %w", err)
	}
	r.log.Info("Posted Event on Node", "node", node, "reason", e.Reason, "message", msg)
	return nil
}
