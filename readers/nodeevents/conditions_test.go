package nodeevents

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	corev1 "k8s.io/api/core/v1"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/tables"
)

// TestConditionDecider: a condition is reported when it appears, not again
// while it holds unchanged, again when its message changes but no sooner
// than MinRepeat, and resolved when it clears; a failed post is retried.
func TestConditionDecider(t *testing.T) {
	var d conditionDecider
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	full := Condition{Key: "nat-table-full/ipv4", Reason: ReasonNATTableFull, Message: "full", ClearedReason: ReasonFlowsAccepted}
	eth1 := Condition{Key: "attach/eth1", Reason: ReasonDeviceNotAttached, Message: "eth1: refused", ClearedReason: ReasonDeviceAttached}
	steps := []struct {
		at         time.Duration
		conds      []Condition
		want       []string // "Type Reason"
		postFailed bool
	}{
		{0, nil, nil, false},
		{time.Second, []Condition{full}, []string{"Warning IPMasqNATTableFull"}, true},
		{2 * time.Second, []Condition{full}, []string{"Warning IPMasqNATTableFull"}, false}, // retried
		{3 * time.Second, []Condition{full, eth1}, []string{"Warning IPMasqDeviceNotAttached"}, false},
		{time.Minute, []Condition{full, eth1}, nil, false},
		// The message changes within MinRepeat: held back.
		{2 * time.Minute, []Condition{full, {Key: eth1.Key, Reason: eth1.Reason, Message: "eth1: other error", ClearedReason: eth1.ClearedReason}}, nil, false},
		{MinRepeat + 4*time.Second, []Condition{full, {Key: eth1.Key, Reason: eth1.Reason, Message: "eth1: other error", ClearedReason: eth1.ClearedReason}},
			[]string{"Warning IPMasqDeviceNotAttached"}, false},
		{MinRepeat + time.Minute, []Condition{full}, []string{"Normal IPMasqDeviceAttached"}, false},
		{MinRepeat + 2*time.Minute, nil, []string{"Normal IPMasqFlowsAccepted"}, false},
		{MinRepeat + 3*time.Minute, nil, nil, false},
	}
	for i, s := range steps {
		now := t0.Add(s.at)
		var got []string
		for _, e := range d.next(now, s.conds) {
			got = append(got, e.event.Type+" "+e.event.Reason)
			if e.event.Type == corev1.EventTypeNormal && !strings.HasPrefix(e.event.Message, "resolved: ") {
				t.Errorf("step %d: resolved message %q", i, e.event.Message)
			}
			if !s.postFailed {
				d.posted(now, e)
			}
		}
		if strings.Join(got, ",") != strings.Join(s.want, ",") {
			t.Fatalf("step %d: Events %v, want %v", i, got, s.want)
		}
	}
}

// TestRefusalSource: refused flows (drops for nat-table-full and
// no-free-port) that rise after the first read make a condition per family
// and reason, naming the flag to change; it clears after clearAfter
// without new refusals. Drops counted before the agent started are not
// news.
func TestRefusalSource(t *testing.T) {
	var devs []bpf.DevCounters
	drops := func(family string, full, noPort uint64) bpf.DevCounters {
		d := bpf.DevCounters{Ifindex: 2, Family: family, Direction: "egress"}
		d.Drops[bpf.DropNATFull], d.Drops[bpf.DropNoPort] = full, noPort
		return d
	}
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s := &refusalSource{
		read:       func() ([]bpf.DevCounters, error) { return devs, nil },
		capacity:   func() ([]bpf.NATMapFill, error) { return []bpf.NATMapFill{{Family: "ipv4", Capacity: 131072}}, nil },
		interval:   time.Hour,
		clearAfter: 5 * time.Minute,
		now:        func() time.Time { return now },
	}
	keys := func() string {
		conds, _ := s.Conditions(nil)
		var k []string
		for _, c := range conds {
			k = append(k, c.Key+" "+c.Reason)
		}
		return strings.Join(k, ",")
	}
	devs = []bpf.DevCounters{drops("ipv4", 5, 0)}
	if got := keys(); got != "" {
		t.Fatalf("drops from before the start: %q", got)
	}
	devs = []bpf.DevCounters{drops("ipv4", 7, 0), drops("ipv6", 0, 1)}
	if got := keys(); got != "nat-table-full/ipv4 IPMasqNATTableFull,no-free-port/ipv6 IPMasqNATPortsExhausted" {
		t.Fatalf("after refusals: %q", got)
	}
	conds, _ := s.Conditions(nil)
	if !strings.Contains(conds[0].Message, "(131072 entries, two per flow); raise --nat-max-entries") ||
		!strings.Contains(conds[1].Message, "widen --nat-port-range") {
		t.Errorf("messages: %q", conds)
	}
	now = now.Add(4 * time.Minute)
	devs = []bpf.DevCounters{drops("ipv4", 8, 0), drops("ipv6", 0, 1)}
	if got := keys(); got != "nat-table-full/ipv4 IPMasqNATTableFull,no-free-port/ipv6 IPMasqNATPortsExhausted" {
		t.Fatalf("within clearAfter: %q", got)
	}
	now = now.Add(2 * time.Minute) // ipv6's last refusal 6 minutes ago, ipv4's 2
	if got := keys(); got != "nat-table-full/ipv4 IPMasqNATTableFull" {
		t.Fatalf("ipv6 quiet for 6 minutes: %q", got)
	}
	s.read = func() ([]bpf.DevCounters, error) { return nil, errors.New("not pinned") }
	if got := keys(); got != "nat-table-full/ipv4 IPMasqNATTableFull" {
		t.Fatalf("unreadable counters keep what holds: %q", got)
	}
}

// TestAttachCondition: a datapath-devices row in error is a condition
// naming the device and the error, through FromTable, whose watch channel
// closes when the table changes.
func TestAttachCondition(t *testing.T) {
	db := statedb.New()
	devices, err := tables.NewDatapathDeviceTable(db)
	if err != nil {
		t.Fatal(err)
	}
	src := FromTable(devices, AttachCondition)
	wtxn := db.WriteTxn(devices)
	devices.Insert(wtxn, &tables.DatapathDevice{Index: 2, Name: "eth0", Status: reconciler.StatusDone()})
	devices.Insert(wtxn, &tables.DatapathDevice{Index: 3, Name: "eth1", Status: reconciler.StatusError(errors.New("tcx: attach refused"))})
	wtxn.Commit()

	conds, watch := src.Conditions(db.ReadTxn())
	if len(conds) != 1 || conds[0].Key != "attach/eth1" || conds[0].Reason != ReasonDeviceNotAttached ||
		conds[0].Message != "eth1: the masquerade programs could not be attached: tcx: attach refused; traffic leaving eth1 is not masqueraded" {
		t.Fatalf("conditions: %+v", conds)
	}
	wtxn = db.WriteTxn(devices)
	devices.Insert(wtxn, &tables.DatapathDevice{Index: 3, Name: "eth1", Status: reconciler.StatusDone()})
	wtxn.Commit()
	select {
	case <-watch:
	case <-time.After(5 * time.Second):
		t.Fatal("watch channel not closed by a change of the table")
	}
	if conds, _ := src.Conditions(db.ReadTxn()); len(conds) != 0 {
		t.Fatalf("after the attach succeeded: %+v", conds)
	}
}

// TestNetfilterCondition: each netfilter-nat-rules row is a condition
// naming the rule as nft -a list ruleset shows it.
func TestNetfilterCondition(t *testing.T) {
	db := statedb.New()
	rules, err := tables.NewNetfilterNATRuleTable(db)
	if err != nil {
		t.Fatal(err)
	}
	src := FromTable(rules, NetfilterCondition)
	wtxn := db.WriteTxn(rules)
	rules.Insert(wtxn, &tables.NetfilterNATRule{Family: "ip", Table: "nat", Chain: "POSTROUTING", Handle: 7,
		Kind: tables.NetfilterMasquerade, Sources: "10.244.0.0/16"})
	wtxn.Commit()
	conds, _ := src.Conditions(db.ReadTxn())
	if len(conds) != 1 || conds[0].Key != "netfilter/ip/nat/POSTROUTING/7/masquerade" || conds[0].Reason != ReasonNetfilterFirst ||
		!strings.HasPrefix(conds[0].Message, "ip nat POSTROUTING handle 7: masquerade from 10.244.0.0/16: netfilter's POSTROUTING runs before") {
		t.Fatalf("conditions: %+v", conds)
	}
}
