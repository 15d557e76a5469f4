package metrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipmasq/ipmasq/tables"
)

// TestConfigLoadsObserve: what the counters make of successive looks at
// the ipmasq-config row.
func TestConfigLoadsObserve(t *testing.T) {
	l := newConfigLoads(nil, nil)
	steps := []struct {
		name            string
		row             tables.ConfigStatus
		loads, failures float64
	}{
		{"first load", tables.ConfigStatus{Generation: 1}, 1, 0},
		{"periodic re-read, unchanged", tables.ConfigStatus{Generation: 1}, 1, 0},
		{"rejected", tables.ConfigStatus{Generation: 1, LastError: "a: bad"}, 1, 1},
		{"same file re-read and rejected again", tables.ConfigStatus{Generation: 1, LastError: "a: bad"}, 1, 1},
		{"another bad file", tables.ConfigStatus{Generation: 1, LastError: "b: bad"}, 1, 2},
		{"two good loads between looks", tables.ConfigStatus{Generation: 3}, 3, 2},
		{"the first bad file again", tables.ConfigStatus{Generation: 3, LastError: "a: bad"}, 3, 3},
	}
	for _, s := range steps {
		row := s.row
		row.Path = "/etc/config/ip-masq-agent"
		l.observe(&row)
		if got := testutil.ToFloat64(l.loads); got != s.loads {
			t.Fatalf("%s: loads %v, want %v", s.name, got, s.loads)
		}
		if got := testutil.ToFloat64(l.failures); got != s.failures {
			t.Fatalf("%s: failures %v, want %v", s.name, got, s.failures)
		}
	}
}
