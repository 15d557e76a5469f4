package nodeevents

import (
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
