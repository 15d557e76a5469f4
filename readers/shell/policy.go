package shell

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"
)

// ErrNotAvailable is what every refused command or flag wraps: test with
// errors.Is.
var ErrNotAvailable = errors.New("not available in the agent's read-only shell")

// allowance is an inspection command the shell offers, minus the flags
// that would make it write.
type allowance struct {
	// refusedFlags maps a flag of the command to why it is refused.
	refusedFlags map[string]string
}

// Why a flag is refused.
const (
	whyOut    = "it writes a file as the agent; the output comes back over the socket without it"
	whyDelete = "it deletes rows of the agent's desired state"
)

var (
	writesFile     = map[string]string{"out": whyOut}
	writesFileRows = map[string]string{"out": whyOut, "delete": whyDelete}
)

// allowed is the shell's allow-list: every command an operator may run on a
// live agent. Each one only reads (tables, maps, the kernel's rules, health)
// or is an operator action that is safe by design: it makes the kernel match
// the desired state sooner than it would anyway (maps/resync, datapath/gc).
// A command that is not listed here is refused, so a command a cell adds
// later stays unavailable until someone decides it is safe and lists it.
var allowed = map[string]allowance{
	// StateDB inspection.
	"db":             {},
	"db/show":        {refusedFlags: writesFile},
	"db/get":         {refusedFlags: writesFileRows},
	"db/list":        {refusedFlags: writesFileRows},
	"db/prefix":      {refusedFlags: writesFileRows},
	"db/lowerbound":  {refusedFlags: writesFileRows},
	"db/dump":        {refusedFlags: writesFile},
	"db/watch":       {},
	"db/initialized": {}, // waits for and reports initialization; marks nothing
	// Health of every module.
	"health": {},
	// The agent's own read commands.
	"ipmasq/status":         {},
	"config/status":         {},
	"maps/dump":             {},
	"maps/stats":            {},
	"datapath/counters":     {},
	"datapath/dev-counters": {},
	"datapath/nat":          {},
	"datapath/handover":     {},
	"rules/dump":            {},
	"rules/stats":           {},
	// Operator actions that only bring forward what the agent does on its
	// own timer: repair map drift, expire idle NAT pairs.
	"maps/resync": {},
	"datapath/gc": {},
}

// Why a command is refused, by kind.
const (
	whyExec     = "it runs programs as the agent (root with NET_ADMIN, BPF and PERFMON)"
	whyFileRead = "it reads files as the agent"
	whyFileEdit = "it changes files as the agent"
	whyTableW   = "it writes the agent's desired state, which the reconcilers then write to the kernel"
	whyTest     = "it is a script-test command"
	whyLife     = "it starts or stops the agent's components"
)

// refused lists the commands the shell knows about and refuses, with the
// reason the error gives. Every command the agent's hive registers, and
// every general script command, is either allowed or listed here (a test
// checks it), so a refusal is a decision, never an accident.
var refused = map[string]string{
	// General script commands (script.DefaultCmds).
	"exec":    whyExec,
	"cat":     whyFileRead,
	"cmp":     whyFileRead,
	"cmpenv":  whyFileRead,
	"exists":  whyFileRead,
	"grep":    whyFileRead,
	"cp":      whyFileEdit,
	"mv":      whyFileEdit,
	"rm":      whyFileEdit,
	"mkdir":   whyFileEdit,
	"chmod":   whyFileEdit,
	"symlink": whyFileEdit,
	"replace": whyFileEdit,
	"sed":     whyFileEdit,
	"cd":      whyTest,
	"echo":    whyTest,
	"env":     whyTest,
	"empty":   whyTest,
	"sleep":   whyTest,
	"stdout":  whyTest,
	"stderr":  whyTest,
	"stop":    whyTest,
	"wait":    whyTest,
	"break":   whyTest,
	// StateDB writes and test assertions.
	"db/insert": whyTableW,
	"db/delete": whyTableW,
	"db/cmp":    whyFileRead + " (a script-test assertion)",
	"db/empty":  whyTest,
	// The hive's own commands (hive.ScriptCommands).
	"hive":       whyTest,
	"hive/start": whyLife,
	"hive/stop":  whyLife,
}

// Allowed reports whether the shell offers the command name.
func Allowed(name string) bool { _, ok := allowed[name]; return ok }

// AllowList is the allowed commands, sorted.
func AllowList() []string { return slices.Sorted(maps.Keys(allowed)) }

// Refused reports whether the shell explicitly refuses the command name.
func Refused(name string) bool { _, ok := refused[name]; return ok }

// refusal is the error of a refused command or flag: one line naming it and
// saying why.
type refusal struct {
	what, why string
}

func (r *refusal) Error() string {
	return fmt.Sprintf("%s: %s; %s (help lists what the shell offers)", r.what, ErrNotAvailable, r.why)
}

func (r *refusal) Unwrap() error { return ErrNotAvailable }

// Commands returns the commands of the read-only shell built from all, the
// commands the hive registers: the allowed ones (their writing flags
// refused), a refusing stand-in for every refused one, and help, which lists
// only what is allowed.
func Commands(all map[string]script.Cmd) map[string]script.Cmd {
	out := make(map[string]script.Cmd, len(all)+len(refused)+1)
	listed := make(map[string]script.Cmd, len(allowed))
	for name, cmd := range all {
		a, ok := allowed[name]
		if !ok {
			continue
		}
		g := &guarded{name: name, cmd: cmd, refusedFlags: a.refusedFlags}
		out[name] = g
		listed[name] = listing{g}
	}
	for name, why := range refused {
		out[name] = refusedCmd(name, why)
	}
	out["help"] = helpCmd(&script.Engine{Cmds: listed})
	return out
}

// guarded is an allowed command that refuses its writing flags.
type guarded struct {
	name         string
	cmd          script.Cmd
	refusedFlags map[string]string
}

func (g *guarded) Usage() *script.CmdUsage { return g.cmd.Usage() }

func (g *guarded) Run(s *script.State, args ...string) (script.WaitFunc, error) {
	for _, flag := range slices.Sorted(maps.Keys(g.refusedFlags)) {
		// The engine parsed the command's flags into s.Flags before Run.
		if s.Flags != nil && s.Flags.Lookup(flag) != nil && s.Flags.Changed(flag) {
			return nil, &refusal{what: g.name + " --" + flag, why: g.refusedFlags[flag]}
		}
	}
	return g.cmd.Run(s, args...)
}

// listing is a guarded command as help shows it: without the refused flags.
type listing struct{ g *guarded }

func (l listing) Run(*script.State, ...string) (script.WaitFunc, error) {
	return nil, errors.New("listing only")
}

func (l listing) Usage() *script.CmdUsage {
	u := *l.g.Usage()
	if orig := u.Flags; orig != nil && len(l.g.refusedFlags) > 0 {
		u.Flags = func(fs *pflag.FlagSet) {
			all := pflag.NewFlagSet(l.g.name, pflag.ContinueOnError)
			orig(all)
			all.VisitAll(func(f *pflag.Flag) {
				if _, no := l.g.refusedFlags[f.Name]; !no {
					fs.AddFlag(f)
				}
			})
		}
	}
	return &u
}

func refusedCmd(name, why string) script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: fmt.Sprintf("%s: %s", ErrNotAvailable, why)},
		func(*script.State, ...string) (script.WaitFunc, error) {
			return nil, &refusal{what: name, why: why}
		})
}

// helpCmd lists the commands of list (the allowed ones). "help -a prefix"
// is what the shell client's tab completion asks.
func helpCmd(list *script.Engine) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "List the shell's commands",
			Args:    "[-v] (regexp)",
			Detail:  []string{"-v shows each command's details and flags; a regexp filters by name: 'help ^db'"},
			RegexpArgs: func(rawArgs ...string) []int {
				var idx []int
				for i, a := range rawArgs {
					if a != "-v" && a != "-a" {
						idx = append(idx, i)
					}
				}
				return idx
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			verbose := false
			if len(args) > 0 {
				switch args[0] {
				case "-a":
					prefix := ""
					if len(args) > 1 {
						prefix = args[1]
					}
					var out []byte
					for _, name := range slices.Sorted(maps.Keys(list.Cmds)) {
						if strings.HasPrefix(name, prefix) {
							out = fmt.Appendf(out, "%s\n", name)
						}
					}
					return func(*script.State) (string, string, error) { return string(out), "", nil }, nil
				case "-v":
					verbose, args = true, args[1:]
				}
			}
			re := ""
			if len(args) > 0 {
				re = args[0]
				verbose = true
			}
			var b strings.Builder
			if err := list.ListCmds(&b, verbose, re); err != nil {
				return nil, err
			}
			return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
		})
}
