package nodeevents

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	corev1 "k8s.io/api/core/v1"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/tables"
)

// A Condition is a state of the node that an operator must act on. While
// it holds, a Warning Event says so: once when it appears, again when its
// message changes (at most every MinRepeat), and a Normal Event when it
// clears (if ClearedReason is set).
type Condition struct {
	// Key identifies the condition across reports, e.g.
	// "nat-table-full/ipv4" or "attach/eth1".
	Key string
	// Reason is the Warning Event's reason (CamelCase, IPMasq...).
	Reason string
	// Message says what is wrong, naming the object and what to do.
	Message string
	// ClearedReason is the Normal Event's reason when the condition no
	// longer holds; empty: none.
	ClearedReason string
}

// ConditionSource reports the conditions that hold now, and a channel that
// is closed when they may have changed.
type ConditionSource interface {
	Conditions(txn statedb.ReadTxn) ([]Condition, <-chan struct{})
}

// SourceOut adds a ConditionSource to the Node's Events. A writer that
// detects something an operator must act on (a table of rows) gets its
// Events by the composition root providing one, e.g.
//
//	cell.Provide(func(t statedb.Table[*tables.Row]) nodeevents.SourceOut {
//		return nodeevents.SourceOut{Source: nodeevents.FromTable(t, rowCondition)}
//	})
type SourceOut struct {
	cell.Out
	Source ConditionSource `group:"node-conditions"`
}

// FromTable is the source of a table: each row for which cond returns true
// is a condition, re-read whenever the table changes.
func FromTable[Obj any](table statedb.Table[Obj], cond func(Obj) (Condition, bool)) ConditionSource {
	return tableSource[Obj]{table: table, cond: cond}
}

type tableSource[Obj any] struct {
	table statedb.Table[Obj]
	cond  func(Obj) (Condition, bool)
}

func (s tableSource[Obj]) Conditions(txn statedb.ReadTxn) ([]Condition, <-chan struct{}) {
	rows, watch := s.table.AllWatch(txn)
	return collect(rows, s.cond), watch
}

func collect[Obj any](rows iter.Seq2[Obj, statedb.Revision], cond func(Obj) (Condition, bool)) []Condition {
	var out []Condition
	for row := range rows {
		if c, ok := cond(row); ok {
			out = append(out, c)
		}
	}
	return out
}

// Reasons of the datapath's conditions.
const (
	ReasonDeviceNotAttached = "IPMasqDeviceNotAttached"
	ReasonDeviceAttached    = "IPMasqDeviceAttached"
	ReasonNATTableFull      = "IPMasqNATTableFull"
	ReasonNATPortsExhausted = "IPMasqNATPortsExhausted"
	ReasonFlowsAccepted     = "IPMasqFlowsAccepted"
	ReasonNetfilterFirst    = "IPMasqNetfilterDecidesFirst"
	ReasonNetfilterGone     = "IPMasqNetfilterRuleGone"
)

// NetfilterCondition is the condition of a netfilter-nat-rules row: a NAT
// rule or chain that decides before the masquerade programs.
func NetfilterCondition(r *tables.NetfilterNATRule) (Condition, bool) {
	return Condition{
		Key:    "netfilter/" + r.Key(),
		Reason: ReasonNetfilterFirst,
		Message: r.String() + ": netfilter's POSTROUTING runs before the masquerade programs, so it decides for the " +
			"packets it matches, not the ip-masq-agent config; remove it (docs/migrate.md)",
		ClearedReason: ReasonNetfilterGone,
	}, true
}

// AttachCondition is the condition of a datapath-devices row whose programs
// could not be attached.
func AttachCondition(d *tables.DatapathDevice) (Condition, bool) {
	if d.Status.Kind != reconciler.StatusKindError {
		return Condition{}, false
	}
	return Condition{
		Key:    "attach/" + d.Name,
		Reason: ReasonDeviceNotAttached,
		Message: fmt.Sprintf("%s: the masquerade programs could not be attached: %s; traffic leaving %s is not masqueraded",
			d.Name, d.Status.GetError(), d.Name),
		ClearedReason: ReasonDeviceAttached,
	}, true
}

// refusalSource turns the datapath's refused new flows (drops for reason
// nat-table-full or no-free-port, per family) into conditions: one holds
// while such drops have risen within the last clearAfter. It reads the
// pinned counters every interval.
type refusalSource struct {
	read       func() ([]bpf.DevCounters, error)
	capacity   func() ([]bpf.NATMapFill, error)
	interval   time.Duration
	clearAfter time.Duration
	now        func() time.Time

	last  map[refusalKey]uint64    // drops at the previous read
	since map[refusalKey]time.Time // when drops last rose
}

type refusalKey struct {
	family string
	reason bpf.DropReason
}

func (s *refusalSource) Conditions(statedb.ReadTxn) ([]Condition, <-chan struct{}) {
	watch := make(chan struct{})
	time.AfterFunc(s.interval, func() { close(watch) })
	devs, err := s.read()
	if err != nil {
		// Not pinned yet (or unreadable): what held before still holds.
		return s.holding(nil), watch
	}
	now := s.now()
	totals := map[refusalKey]uint64{}
	for _, d := range devs {
		for _, r := range []bpf.DropReason{bpf.DropNATFull, bpf.DropNoPort} {
			totals[refusalKey{d.Family, r}] += d.Drops[r]
		}
	}
	if s.last == nil {
		// The counters survive restarts: only what rises from now on is news.
		s.last, s.since = totals, map[refusalKey]time.Time{}
		return nil, watch
	}
	for k, n := range totals {
		if n > s.last[k] {
			s.since[k] = now
		}
	}
	s.last = totals
	for k, at := range s.since {
		if now.Sub(at) >= s.clearAfter {
			delete(s.since, k)
		}
	}
	return s.holding(s.capacity), watch
}

// holding is the conditions of the refusals seen within clearAfter.
func (s *refusalSource) holding(capacity func() ([]bpf.NATMapFill, error)) []Condition {
	caps := map[string]int{}
	if capacity != nil {
		if fill, err := capacity(); err == nil {
			for _, f := range fill {
				caps[f.Family] = f.Capacity
			}
		}
	}
	var out []Condition
	for k := range s.since {
		c := Condition{Key: fmt.Sprintf("%s/%s", k.reason, k.family), ClearedReason: ReasonFlowsAccepted}
		switch k.reason {
		case bpf.DropNATFull:
			c.Reason = ReasonNATTableFull
			c.Message = fmt.Sprintf("new %s flows are refused: the NAT table could not make room for them", k.family)
			if n := caps[k.family]; n > 0 {
				c.Message += fmt.Sprintf(" (%d entries, two per flow)", n)
			}
			c.Message += "; raise --nat-max-entries (ipmasq-agent nat --summary shows what holds it)"
		default:
			c.Reason = ReasonNATPortsExhausted
			c.Message = fmt.Sprintf("new %s flows are refused: no port of --nat-port-range is free toward their destination; "+
				"widen --nat-port-range (ipmasq-agent nat --summary --dst <destination> shows who holds them)", k.family)
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b Condition) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// MinRepeat is the least time between two Warning Events of one condition
// whose message changed.
const MinRepeat = 10 * time.Minute

// conditionDecider turns the conditions that hold into Events: a Warning
// when a condition appears, another when its message changes (at most every
// MinRepeat), a Normal one when it clears.
type conditionDecider struct {
	reported map[string]reportedCondition
}

type reportedCondition struct {
	cond Condition
	at   time.Time
}

// pendingEvent is an Event for one condition's key.
type pendingEvent struct {
	key   string
	cond  Condition
	event Event
}

// next returns the Events that conds call for at now; call posted for each
// that reached the API server, so a failed post is tried again.
func (d *conditionDecider) next(now time.Time, conds []Condition) []pendingEvent {
	var out []pendingEvent
	holds := map[string]bool{}
	for _, c := range conds {
		holds[c.Key] = true
		r, ok := d.reported[c.Key]
		if ok && (r.cond.Message == c.Message || now.Sub(r.at) < MinRepeat) {
			continue
		}
		out = append(out, pendingEvent{key: c.Key, cond: c,
			event: Event{Type: corev1.EventTypeWarning, Reason: c.Reason, Message: c.Message}})
	}
	for key, r := range d.reported {
		if holds[key] {
			continue
		}
		e := pendingEvent{key: key}
		if r.cond.ClearedReason != "" {
			e.event = Event{Type: corev1.EventTypeNormal, Reason: r.cond.ClearedReason,
				Message: "resolved: " + r.cond.Message}
		}
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b pendingEvent) int { return strings.Compare(a.key, b.key) })
	return out
}

// posted records e as reported (a Warning) or resolved.
func (d *conditionDecider) posted(now time.Time, e pendingEvent) {
	if d.reported == nil {
		d.reported = map[string]reportedCondition{}
	}
	if e.event.Type == corev1.EventTypeWarning {
		d.reported[e.key] = reportedCondition{cond: e.cond, at: now}
	} else {
		delete(d.reported, e.key)
	}
}

// conditionReporter posts the Events of every source's conditions.
type conditionReporter struct {
	poster  *poster
	db      *statedb.DB
	sources []ConditionSource
	d       conditionDecider
}

// run re-reads the sources whenever one of them may have changed; a post
// that fails is retried every few seconds.
func (r *conditionReporter) run(ctx context.Context, health cell.Health) error {
	const retry = 2 * time.Second
	for {
		ws := statedb.NewWatchSet()
		txn := r.db.ReadTxn()
		var conds []Condition
		for _, s := range r.sources {
			cs, watch := s.Conditions(txn)
			conds = append(conds, cs...)
			ws.Add(watch)
		}
		failed := false
		for _, e := range r.d.next(time.Now(), conds) {
			if e.event.Reason != "" {
				if err := r.poster.post(ctx, &e.event); err != nil {
					health.Degraded("post Event "+e.event.Reason+" on Node "+r.poster.client.NodeName, err)
					failed = true
					continue
				}
			}
			r.d.posted(time.Now(), e)
		}
		if !failed {
			health.OK(fmt.Sprintf("%d conditions reported", len(r.d.reported)))
		}
		wctx, cancel := ctx, context.CancelFunc(func() {})
		if failed {
			wctx, cancel = context.WithTimeout(ctx, retry)
		}
		_, err := ws.Wait(wctx, 0)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
	}
}
