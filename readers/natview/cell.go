package natview

import (
	"bytes"
	"io"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/settings"
)

// Cell provides the shell's datapath/nat command, which reads the pinned
// NAT maps under --bpf-root.
var Cell = cell.Module(
	"nat-view",
	"The NAT pairs like conntrack -L",

	cell.Provide(commands),
)

func commands(cfg settings.Config) hive.ScriptCmdsOut {
	src := bpf.Pinned{Dir: cfg.PinDir()}
	return hive.NewScriptCmds(map[string]script.Cmd{
		"datapath/nat": script.Command(
			script.CmdUsage{
				Summary: "List the NAT pairs like conntrack -L: kind, family, protocol, state, age, expiry, original and translated tuple",
				Args:    "[--src A|P] [--dst A|P] [--port N] [--proto P] [--state S] [--kind K] [-o text|json] [--summary|-S] [--count|-C]",
				Detail:  strings.Split(strings.TrimSpace(Usage()), "\n"),
			},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				var out bytes.Buffer
				err := Run(&out, src, args)
				return func(*script.State) (string, string, error) { return out.String(), "", err }, nil
			}),
	})
}

// Run parses args as the nat command's flags and writes the listing.
func Run(w io.Writer, src Source, args []string) error {
	var o Options
	fs := pflag.NewFlagSet("datapath/nat", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	return Write(w, src, o)
}

// Usage is the flags' help text.
func Usage() string {
	var o Options
	fs := pflag.NewFlagSet("datapath/nat", pflag.ContinueOnError)
	o.AddFlags(fs)
	return fs.FlagUsages()
}
