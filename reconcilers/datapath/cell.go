package datapath

import (
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell loads the masquerade datapath (package bpf) when the hive starts:
// it loads the programs with their pinned maps and sets the NAT port
// ranges, lifetimes and port policy (it writes no sysctl: the programs
// check the node's sockets instead of reserving ports), and provides the
// loaded datapath (*Handle) and the datapath's flags (Config) to the
// reconcilers of its kernel objects. The agent puts it first in the
// "datapath" module, before those reconcilers (reconcilers/tcattach,
// masqrules, masqsources, nodeaddrs, natgc), so that the programs are
// loaded before their jobs start. It is the one owner of every pinned map,
// the nonmasq tries included, which reconcilers/nonmasqmaps fills through
// the loaded datapath as the others fill theirs.
var Cell = cell.Group(
	cell.Config(DefaultConfig),
	cell.Provide(
		newHandle,
		scriptCommands,
		newNATSizing,
		newVariant,
	),
	cell.Invoke(register),
)

type params struct {
	cell.In

	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	Agent     settings.Config
	Config    Config
	Handle    *Handle
	NATSize   natSizing
	Variant   tables.DatapathVariant
}

func register(p params) error {
	ports, portWarnings, err := ParsePortRanges("--nat-port-range", p.Config.NATPortRange)
	if err != nil {
		return err
	}
	lifetimes, err := p.Config.Lifetimes()
	if err != nil {
		return err
	}
	natSize := p.NATSize
	if p.Config.NATGCInterval <= 0 {
		return fmt.Errorf("--nat-gc-interval=%s: want a positive duration, e.g. 10s", p.Config.NATGCInterval)
	}
	switch p.Config.TCAttachMode {
	case AttachAuto, AttachTCX, AttachClsact:
	default:
		return fmt.Errorf("--tc-attach-mode=%q: want auto, tcx or clsact", p.Config.TCAttachMode)
	}
	pinDir := p.Agent.PinDir()
	p.Lifecycle.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			for _, w := range portWarnings {
				p.Log.Warn(w)
			}
			if natSize.TooSmall || natSize.OverBudget {
				p.Log.Warn("NAT maps sized", "size", natSize.String())
			} else {
				p.Log.Info("NAT maps sized", "size", natSize.String())
			}
			dp, err := bpf.Load(bpf.LoadOptions{
				PinDir:            pinDir,
				NonMasqMaxEntries: p.Agent.MaxNonMasqCIDRs,
				NATMaxEntriesV4:   natSize.V4(),
				NATMaxEntriesV6:   natSize.V6(),
				Logger:            p.Log,
				Variant:           bpf.Variant(p.Variant.Variant),
			})
			if err != nil {
				return err
			}
			p.Log.Info("Datapath loaded", "variant", dp.Variant, "reason", p.Variant.Reason,
				"kernel", kernelRelease(), "attach-mode", p.Config.TCAttachMode)
			if err := dp.SetPortRanges(ports.Pairs()); err != nil {
				dp.Close()
				return err
			}
			if err := dp.SetLifetimes(lifetimes); err != nil {
				dp.Close()
				return err
			}
			if err := dp.SetKeepSourcePort(p.Config.NATKeepSourcePort); err != nil {
				dp.Close()
				return err
			}
			if err := dp.SetRandomFully(p.Config.NATRandomFully); err != nil {
				dp.Close()
				return err
			}
			p.Handle.dp.Store(dp)
			return nil
		},
		OnStop: func(cell.HookContext) error {
			// Programs stay attached and maps pinned: closing only drops
			// the agent's references.
			if dp := p.Handle.dp.Swap(nil); dp != nil {
				return dp.Close()
			}
			return nil
		},
	})
	return nil
}
