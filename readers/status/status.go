// Package status gives operators a short, human summary of a running agent
// ("ipmasq-agent status") and the config status command, as script commands
// served by the agent's shell. It only reads tables and, read-only, the pinned maps.
package status

import (
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/readers/readiness"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell provides the ipmasq/status and config/status commands.
var Cell = cell.Module(
	"status",
	"Human summary of the agent state",

	cell.Provide(commands),
)

type sources struct {
	cell.In

	DB        *statedb.DB
	Agent     settings.Config
	Config    statedb.Table[*tables.ConfigStatus]
	CIDRs     statedb.Table[*tables.NonMasqCIDR]
	Endpoints statedb.Table[*tables.Endpoint]             `optional:"true"`
	Rules     statedb.Table[*tables.IPRule]               `optional:"true"`
	Devices   statedb.Table[*tables.EgressDevice]         `optional:"true"`
	Attached  statedb.Table[*tables.DatapathDevice]       `optional:"true"`
	RuleSrcs  statedb.Table[*tables.MasqueradeRuleSource] `optional:"true"`
	Sources   statedb.Table[*tables.MasqueradeSource]     `optional:"true"`
	NATSize   tables.NATSizing                            `optional:"true"`
	Netfilter statedb.Table[*tables.NetfilterNATRule]     `optional:"true"`
	Handover  statedb.Table[*tables.Handover]             `optional:"true"`
	Readiness *readiness.Checker                          `optional:"true"`
	Variant   tables.DatapathVariant                      `optional:"true"`
}

func commands(s sources) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"ipmasq/status": script.Command(
			script.CmdUsage{Summary: "Summary of the agent: config, prefixes, devices, endpoints, reconciliation, NAT occupancy"},
			func(*script.State, ...string) (script.WaitFunc, error) {
				out := s.summary()
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
		"config/status": script.Command(
			script.CmdUsage{Summary: "The config file's state: origin, generation, last good load, last error"},
			func(*script.State, ...string) (script.WaitFunc, error) {
				var b strings.Builder
				s.writeConfig(&b, s.DB.ReadTxn())
				out := b.String()
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
	})
}

func (s sources) summary() string {
	txn := s.DB.ReadTxn()
	var b strings.Builder
	s.writeConfig(&b, txn)

	var v4, v6, masq int
	for c := range s.CIDRs.All(txn) {
		switch {
		case c.Action == tables.ActionMasquerade:
			masq++
		case c.Prefix.Addr().Is4():
			v4++
		default:
			v6++
		}
	}
	fmt.Fprintf(&b, "Prefixes:   %d IPv4 and %d IPv6 no-masquerade, %d masquerade exceptions (map capacity %d per family); %s\n",
		v4, v6, masq, s.Agent.MaxNonMasqCIDRs, reconciled(statusesOf(s.CIDRs, txn, (*tables.NonMasqCIDR).GetStatus)))

	var notReady []readiness.Condition
	if s.Readiness != nil {
		notReady = s.Readiness.NotReady()
		if len(notReady) == 0 {
			fmt.Fprintf(&b, "Readiness:  ready\n")
		} else {
			fmt.Fprintf(&b, "Readiness:  NOT READY: %s\n", joinConditions(notReady))
		}
	}
	if s.Devices != nil {
		// Each selected device with why: an operator checks that every
		// uplink is there, and that no pod interface is.
		var sel []string
		for d := range s.Devices.All(txn) {
			if d.Selected {
				sel = append(sel, fmt.Sprintf("%s (%s; %s)", d.Name, joinAddrs(d.SNATv4, d.SNATv6), d.Reason))
			}
		}
		fmt.Fprintf(&b, "Devices:    selected %s\n", orNone(strings.Join(sel, ", ")))
	}
	if s.Attached != nil {
		var att []string
		for d := range s.Attached.All(txn) {
			att = append(att, fmt.Sprintf("%s [%s]", d.Name, tables.StatusString(d.Status)))
		}
		fmt.Fprintf(&b, "Datapath:   attached to %s\n", orNone(strings.Join(att, ", ")))
	}
	if s.Variant.Variant != "" {
		fmt.Fprintf(&b, "Variant:    %s (%s), --tc-attach-mode=%s\n", s.Variant.Variant, s.Variant.Reason, s.Variant.AttachMode)
	}
	if s.Sources != nil {
		fmt.Fprintf(&b, "Sources:    masquerading %s; %s\n", tables.DescribeMasqueradeSources(s.Sources.All(txn)),
			reconciled(statusesOf(s.Sources, txn, (*tables.MasqueradeSource).GetStatus)))
	}
	if s.Netfilter != nil {
		if rows := tables.NetfilterNATRules(s.Netfilter.All(txn)); len(rows) == 0 {
			fmt.Fprintf(&b, "Netfilter:  no NAT rule decides before ipmasq\n")
		} else if s.Readiness != nil && len(notReady) > 0 {
			// The old rules may be all that masquerades this node's pods:
			// removing them now would send their traffic out unmasqueraded.
			fmt.Fprintf(&b, "Netfilter:  %d NAT rule(s) decide before ipmasq; keep them, this node is not ready (see Readiness; docs/migrate.md): %s\n",
				len(rows), tables.DescribeNetfilterNATRules(rows))
		} else {
			fmt.Fprintf(&b, "Netfilter:  %d NAT rule(s) decide before ipmasq, remove them once every node is ready (docs/migrate.md): %s\n",
				len(rows), tables.DescribeNetfilterNATRules(rows))
		}
	}
	if s.Handover != nil {
		if h := tables.HandoverRow(txn, s.Handover); h != nil {
			fmt.Fprintf(&b, "Handover:   %s\n", h.Describe())
		}
	}
	if s.RuleSrcs != nil {
		fmt.Fprintf(&b, "Rules:      %d masquerade rule source(s) on devices; %s\n",
			s.RuleSrcs.NumObjects(txn), reconciled(statusesOf(s.RuleSrcs, txn, (*tables.MasqueradeRuleSource).GetStatus)))
	}
	if s.Endpoints != nil {
		withTable := 0
		for ep := range s.Endpoints.All(txn) {
			if ep.RouteTable != 0 {
				withTable++
			}
		}
		fmt.Fprintf(&b, "Endpoints:  %d (%d with a route table)\n", s.Endpoints.NumObjects(txn), withTable)
	}
	if s.Rules != nil {
		fmt.Fprintf(&b, "ip rules:   %d; %s\n", s.Rules.NumObjects(txn), reconciled(statusesOf(s.Rules, txn, (*tables.IPRule).GetStatus)))
	}
	if s.Attached != nil {
		// From the pins, so the summary needs no handle of the datapath
		// reconciler.
		// Each family's own capacity: a disabled family's map is small.
		if fill, err := (bpf.Pinned{Dir: s.Agent.PinDir()}).NATFill(); err == nil {
			fmt.Fprintf(&b, "NAT:        %d of %d IPv4 and %d of %d IPv6 entries (two per flow)\n",
				fill[0].Entries, fill[0].Capacity, fill[1].Entries, fill[1].Capacity)
			if s.NATSize.Summary != "" {
				fmt.Fprintf(&b, "NAT size:   %s\n", s.NATSize.Summary)
			}
		} else {
			fmt.Fprintf(&b, "NAT:        %v\n", err)
		}
		if fill, err := (bpf.Pinned{Dir: s.Agent.PinDir()}).UnmasqFill(); err == nil && len(fill) == 2 {
			fmt.Fprintf(&b, "Unmasq:     %d IPv4 and %d IPv6 flows kept unmasqueraded through config changes (records %d and %d at most, least recently used evicted)\n",
				fill[0].Entries, fill[1].Entries, fill[0].Capacity, fill[1].Capacity)
		} else if err != nil {
			fmt.Fprintf(&b, "Unmasq:     %v\n", err)
		}
	}
	return b.String()
}

func (s sources) writeConfig(b *strings.Builder, txn statedb.ReadTxn) {
	for st := range s.Config.All(txn) {
		state := "ok"
		switch {
		case st.LastError != "" && len(st.Files) > 0:
			// Several files merged: the rejected one keeps its last good
			// content in the merge, the others' changes apply.
			state = "REJECTED (the other files stay applied, this one with its last good content if it had one): " + st.LastError
		case st.LastError != "":
			state = "REJECTED (last good config kept): " + st.LastError
		}
		good := "never"
		if !st.LastGoodLoad.IsZero() {
			good = st.LastGoodLoad.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(b, "Config:     %s (%s, generation %d, last good load %s, resync %s): %s\n",
			st.Path, st.Origin, st.Generation, good, st.ResyncInterval, state)
		if len(st.Files) > 0 {
			fmt.Fprintf(b, "Merged:     %d files: %s\n", len(st.Files), strings.Join(st.Files, ", "))
		}
		for _, w := range st.Warnings {
			fmt.Fprintf(b, "Warning:    %s: %s\n", w.Kind, w.Message)
		}
	}
}

func joinConditions(conds []readiness.Condition) string {
	s := make([]string, len(conds))
	for i, c := range conds {
		s[i] = c.String()
	}
	return strings.Join(s, "; ")
}

func statusesOf[T any](tbl statedb.Table[T], txn statedb.ReadTxn, get func(T) reconciler.Status) (done, pending, failed int) {
	for obj := range tbl.All(txn) {
		switch get(obj).Kind {
		case reconciler.StatusKindDone:
			done++
		case reconciler.StatusKindError:
			failed++
		default:
			pending++
		}
	}
	return
}

func reconciled(done, pending, failed int) string {
	return fmt.Sprintf("in the kernel: %d done, %d pending, %d failing", done, pending, failed)
}

func joinAddrs(addrs ...netip.Addr) string {
	var out []string
	for _, a := range addrs {
		if a.IsValid() {
			out = append(out, a.String())
		}
	}
	return orNone(strings.Join(out, ", "))
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}
