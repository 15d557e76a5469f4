package datapath

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/tables"
)

// scriptCommands are the shell and script-test commands of the datapath
// (datapath/nat, which only reads the pins, is readers/natview's):
//
//	datapath/counters  the datapath's counters, summed over CPUs
//	datapath/gc        expire idle NAT pairs now
func scriptCommands(l *Handle, db *statedb.DB, cfg Config, nodeAddrs statedb.Table[*tables.NodeAddress],
	srcs statedb.Table[*tables.MasqueradeRuleSource]) hive.ScriptCmdsOut {
	// Bad lifetimes stop the agent in register; these are never used then.
	lifetimes, _ := cfg.Lifetimes()
	return hive.NewScriptCmds(map[string]script.Cmd{
		"datapath/counters": script.Command(
			script.CmdUsage{Summary: "Show the datapath counters (summed over CPUs)"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				dp := l.get()
				if dp == nil {
					return nil, ErrNotLoaded
				}
				out, err := FormatCounters(dp)
				return func(*script.State) (string, string, error) { return out, "", err }, nil
			}),
		"datapath/gc": script.Command(
			script.CmdUsage{Summary: "Expire idle NAT entries now"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				c := &collector{dp: l, lifetimes: lifetimes, snat: func() (map[netip.Addr]bool, bool) {
					return liveSNATAddrs(db, nodeAddrs, srcs)
				}}
				return nil, c.collectNow()
			}),
	})
}

// FormatCounters prints "name value" lines for every counter.
func FormatCounters(dp *bpf.Datapath) (string, error) {
	vals, err := bpf.ReadCounters(dp.Maps.Counters)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for i, v := range vals {
		fmt.Fprintf(&b, "%s %d\n", bpf.Counter(i), v)
	}
	return b.String(), nil
}
