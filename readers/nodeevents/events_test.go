package nodeevents

import (
	"slices"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/tables"
)

// TestDecider walks a file through good, rejected (twice the same error,
// then another), and good again: one Event per distinct rejection and one
// when a good file follows; a failed post (posted not called) is retried.
func TestDecider(t *testing.T) {
	var d decider
	steps := []struct {
		lastError  string
		want       string // reason, or "" for no Event
		postFailed bool
	}{
		{"", "", false},
		{"f: nonMasqueradeCIDRs[0]: x is not a CIDR", ReasonRejected, false},
		{"f: nonMasqueradeCIDRs[0]: x is not a CIDR", "", false},
		{"f: masqLinkLocal: \"yes\" is not a boolean", ReasonRejected, true},
		{"f: masqLinkLocal: \"yes\" is not a boolean", ReasonRejected, false},
		{"f: masqLinkLocal: \"yes\" is not a boolean", "", false},
		{"", ReasonAccepted, false},
		{"", "", false},
		{"f: nonMasqueradeCIDRs[0]: x is not a CIDR", ReasonRejected, false},
	}
	for i, s := range steps {
		e := d.next(&tables.ConfigStatus{Path: "f", LastError: s.lastError, Generation: 3})
		got := ""
		if e != nil {
			got = e.Reason
			if e.Reason == ReasonRejected && e.Message != s.lastError {
				t.Errorf("step %d: message %q, want the error %q", i, e.Message, s.lastError)
			}
			if !s.postFailed {
				d.posted(e)
			}
		}
		if got != s.want {
			t.Fatalf("step %d (lastError %q): Event %q, want %q", i, s.lastError, got, s.want)
		}
	}
}

// TestDeciderWarnings: an applied config with an unknown key gets one
// Warning Event naming the key and the key likely meant, one per distinct
// set of warnings, and one when they are gone; a rejection beside warnings
// (a refused merged file) gets both Events.
func TestDeciderWarnings(t *testing.T) {
	unknown := tables.ConfigWarning{Kind: tables.ConfigWarningUnknownKey,
		Message: `f: unknown key "resyncIntervall" ignored (did you mean resyncInterval? known keys: ...)`}
	conflict := tables.ConfigWarning{Kind: tables.ConfigWarningConflict, Message: "masqLinkLocal: true in a, false in b"}
	var d decider
	steps := []struct {
		lastError string
		warnings  []tables.ConfigWarning
		want      []string // reasons, in order
	}{
		{"", nil, nil},
		{"", []tables.ConfigWarning{unknown}, []string{ReasonWarnings}},
		{"", []tables.ConfigWarning{unknown}, nil},
		{"", []tables.ConfigWarning{unknown, conflict}, []string{ReasonWarnings}},
		{"g: bad", []tables.ConfigWarning{unknown, conflict}, []string{ReasonRejected}},
		{"", nil, []string{ReasonAccepted, ReasonWarningsCleared}},
		{"g: bad", []tables.ConfigWarning{unknown}, []string{ReasonRejected, ReasonWarnings}},
	}
	for i, s := range steps {
		st := &tables.ConfigStatus{Path: "f", LastError: s.lastError, Warnings: s.warnings, Generation: 3}
		var got []string
		for e := d.next(st); e != nil; e = d.next(st) {
			got = append(got, e.Reason)
			if e.Reason == ReasonWarnings {
				for _, w := range s.warnings {
					if !strings.Contains(e.Message, w.Message) {
						t.Errorf("step %d: message %q lacks %q", i, e.Message, w.Message)
					}
				}
			}
			d.posted(e)
			if len(got) > 4 {
				t.Fatalf("step %d: Events never stop: %v", i, got)
			}
		}
		if !slices.Equal(got, s.want) {
			t.Fatalf("step %d: Events %v, want %v", i, got, s.want)
		}
	}
}
