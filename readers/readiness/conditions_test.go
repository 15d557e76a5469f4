package readiness

import (
	"errors"
	"strings"
	"testing"

	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// TestConditions: each condition holds exactly when the node cannot do
// that part of its job, and says why.
func TestConditions(t *testing.T) {
	for _, c := range []struct {
		name string
		got  func() (Condition, bool)
		want string // "" : does not hold
	}{
		{"no config row", func() (Condition, bool) { return configCondition(nil) }, "config: no config loaded yet;"},
		{"never loaded", func() (Condition, bool) {
			return configCondition([]*tables.ConfigStatus{{Path: "/etc/x", Origin: tables.ConfigOriginNone, LastError: "bad CIDR"}})
		}, "config: no config loaded yet from /etc/x: bad CIDR;"},
		{"defaults", func() (Condition, bool) {
			return configCondition([]*tables.ConfigStatus{{Path: "/etc/x", Origin: tables.ConfigOriginDefaults}})
		}, ""},
		{"rejected edit, last good kept", func() (Condition, bool) {
			return configCondition([]*tables.ConfigStatus{{Path: "/etc/x", Origin: tables.ConfigOriginFile, LastError: "bad"}})
		}, ""},
		{"no device", func() (Condition, bool) { return datapathCondition(nil) }, "datapath: no egress device is selected"},
		{"none attached", func() (Condition, bool) {
			return datapathCondition([]*tables.DatapathDevice{
				{Name: "eth1", Status: reconciler.StatusError(errors.New("refused"))},
				{Name: "eth0", Status: reconciler.StatusPending()},
			})
		}, "datapath: the masquerade programs are attached to none of the selected devices: eth0 (pending), eth1 (refused)"},
		{"one attached", func() (Condition, bool) {
			return datapathCondition([]*tables.DatapathDevice{
				{Name: "eth1", Status: reconciler.StatusError(errors.New("refused"))},
				{Name: "eth0", Status: reconciler.StatusDone()},
			})
		}, ""},
		{"no Kubernetes", func() (Condition, bool) { return nodeCondition(nil) }, ""},
		{"Node read", func() (Condition, bool) {
			return nodeCondition([]*tables.KubernetesNode{{Name: "n1", State: tables.NodeRead}})
		}, ""},
		{"Node not read yet", func() (Condition, bool) {
			return nodeCondition([]*tables.KubernetesNode{{Name: "n1", State: tables.NodeReading}})
		}, "Node n1: reading"},
		{"Node forbidden", func() (Condition, bool) {
			return nodeCondition([]*tables.KubernetesNode{{Name: "n1", State: tables.NodeReadFailed, Error: "forbidden"}})
		}, "Node n1: failed: forbidden"},
	} {
		cond, holds := c.got()
		if holds != (c.want != "") || holds && !strings.Contains(cond.String(), c.want) {
			t.Errorf("%s: holds %v, %q; want %q", c.name, holds, cond.String(), c.want)
		}
	}
}
