package datapath

import (
	"fmt"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/ipmasq/ipmasq/bpf"
)

// scriptCommands are the shell and script-test commands of the loaded
// datapath (datapath/nat, which only reads the pins, is readers/natview's;
// datapath/gc is reconcilers/natgc's):
//
//	datapath/counters      the datapath's counters, summed over CPUs
//	datapath/dev-counters  the per-device outcomes, one line per device, family and direction
func scriptCommands(l *Handle) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"datapath/dev-counters": script.Command(
			script.CmdUsage{Summary: "Show the per-device packet outcomes (summed over CPUs): ifindex, family, direction, passed, translated, dropped"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				dp := l.Get()
				if dp == nil {
					return nil, ErrNotLoaded
				}
				devs, err := bpf.ReadDevCounters(dp.Maps.DevCounters)
				var b strings.Builder
				for _, d := range devs {
					fmt.Fprintf(&b, "ifindex=%d %s %s passed=%d translated=%d dropped=%d\n", d.Ifindex, d.Family, d.Direction,
						d.Packets[bpf.ActionPassed], d.Packets[bpf.ActionTranslated], d.Packets[bpf.ActionDropped])
				}
				return func(*script.State) (string, string, error) { return b.String(), "", err }, nil
			}),
		"datapath/counters": script.Command(
			script.CmdUsage{Summary: "Show the datapath counters (summed over CPUs)"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				dp := l.Get()
				if dp == nil {
					return nil, ErrNotLoaded
				}
				out, err := FormatCounters(dp)
				return func(*script.State) (string, string, error) { return out, "", err }, nil
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
