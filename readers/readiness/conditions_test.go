package readiness

import (
	"errors"
	"net/netip"
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
		{"no device", func() (Condition, bool) { return datapathCondition(nil, nil) }, "datapath: no egress device is selected"},
		{"none attached", func() (Condition, bool) {
			return datapathCondition([]*tables.DatapathDevice{
				{Index: 3, Name: "eth1", Status: reconciler.StatusError(errors.New("refused"))},
				{Index: 2, Name: "eth0", Status: reconciler.StatusPending()},
			}, nil)
		}, "datapath: the masquerade programs are not attached to every selected device, traffic leaving through these is not masqueraded: eth0 (pending), eth1 (refused)"},
		// One uplink without the programs is one uplink whose pods'
		// traffic leaves unmasqueraded.
		{"one of two attached", func() (Condition, bool) {
			return datapathCondition([]*tables.DatapathDevice{
				{Index: 3, Name: "eth1", Status: reconciler.StatusError(errors.New("refused"))},
				{Index: 2, Name: "eth0", Status: reconciler.StatusDone()},
			}, nil)
		}, "not attached to every selected device, traffic leaving through these is not masqueraded: eth1 (refused)"},
		{"all attached", func() (Condition, bool) {
			return datapathCondition([]*tables.DatapathDevice{
				{Index: 3, Name: "eth1", Status: reconciler.StatusDone()},
				{Index: 2, Name: "eth0", Status: reconciler.StatusDone()},
			}, []*tables.EgressDevice{{Index: 2, Name: "eth0"}, {Index: 3, Name: "eth1"}})
		}, ""},
		// Selected, but its datapath row not derived yet.
		{"selected device not in the datapath yet", func() (Condition, bool) {
			return datapathCondition([]*tables.DatapathDevice{
				{Index: 2, Name: "eth0", Status: reconciler.StatusDone()},
			}, []*tables.EgressDevice{{Index: 2, Name: "eth0"}, {Index: 4, Name: "eth2"}})
		}, ": eth2 (pending)"},
		{"sources not derived", func() (Condition, bool) { return sourcesCondition(false, nil) }, "sources: the masquerade sources are not known yet"},
		{"every source", func() (Condition, bool) {
			return sourcesCondition(true, []*tables.MasqueradeSource{
				{Prefix: netip.MustParsePrefix("0.0.0.0/0"), Masquerade: true, Origin: tables.OriginEverySource},
				{Prefix: netip.MustParsePrefix("10.0.0.5/32"), Origin: tables.OriginNodeAddress},
			})
		}, ""},
		{"pod CIDRs only, none known", func() (Condition, bool) {
			return sourcesCondition(true, []*tables.MasqueradeSource{
				{Prefix: netip.MustParsePrefix("192.168.6.0/24"), Rules: true, Origin: tables.OriginMasqueradeRule},
			})
		}, "sources: no source is masqueraded: --masquerade-pod-cidrs-only and no pod CIDR is known"},
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
