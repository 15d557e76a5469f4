package datapath

import (
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell runs the masquerade datapath. It needs the tables of cells/datapath,
// which it reconciles into tc attachments and the programs' maps; the
// programs read the nonmasq tries that nonmasq-maps writes, through the same
// pins (whichever starts first creates them).
var Cell = cell.Module(
	"datapath",
	"eBPF masquerade datapath",

	cell.Config(DefaultConfig),
	cell.Provide(
		newHandle,
		scriptCommands,
		// The Operations of the kernel-writing reconcilers, in the hive so
		// that tests decorate them (fault injection) the way statedb's
		// example does.
		newAttachOps,
		newMasqRuleOps,
		func() PortReservation { return reserveNATPorts },
	),
	cell.Invoke(register),
)

type params struct {
	cell.In

	Log       *slog.Logger
	DB        *statedb.DB
	Jobs      job.Registry
	Health    cell.Health
	ModuleID  cell.FullModuleID
	Lifecycle cell.Lifecycle
	Agent     settings.Config
	Config    Config
	// Devices gives the collector every address of the node (a pair ends
	// only when its address is deleted).
	Devices     statedb.Table[*tables.EgressDevice]
	DPDevices   statedb.RWTable[*tables.DatapathDevice]
	RuleSources statedb.RWTable[*tables.MasqueradeRuleSource]
	Sources     statedb.RWTable[*tables.MasqueradeSource]
	NodeAddrs   statedb.RWTable[*tables.NodeAddress]
	Handle      *Handle
	// Reserve keeps the NAT ports from the node's own connections.
	Reserve PortReservation
	// Metrics is the hive's reconciler metrics, when it has any.
	Metrics     reconciler.Metrics `optional:"true"`
	AttachOps   reconciler.Operations[*tables.DatapathDevice]
	MasqRuleOps reconciler.Operations[*tables.MasqueradeRuleSource]
}

type attachParams struct {
	cell.In

	DB        *statedb.DB
	Agent     settings.Config
	Config    Config
	Handle    *Handle
	Sources   statedb.Table[*tables.MasqueradeSource]
	NodeAddrs statedb.Table[*tables.NodeAddress]
}

// PortReservation keeps the NAT port range from the node's own connections
// (see reserveNATPorts) and says what it did, for the log. It is in the
// hive so that a test runs it in its own network namespace.
type PortReservation func(PortRange) (note string, err error)

// newAttachOps are the operations of the tc-attach reconciler.
func newAttachOps(p attachParams) reconciler.Operations[*tables.DatapathDevice] {
	return &attachOps{linkDir: filepath.Join(p.Agent.PinDir(), "links"), dp: p.Handle, mode: p.Config.TCAttachMode,
		waitMaps: waitMapsWritten(p.DB, p.Sources, p.NodeAddrs)}
}

// newMasqRuleOps are the operations of the masq-rules reconciler.
func newMasqRuleOps(h *Handle) reconciler.Operations[*tables.MasqueradeRuleSource] {
	return &lazyOps[*tables.MasqueradeRuleSource]{dp: h, build: masqRuleOps}
}

func register(p params) error {
	ports, err := ParsePortRange("--nat-port-range", p.Config.NATPortRange)
	if err != nil {
		return err
	}
	lifetimes, err := p.Config.Lifetimes()
	if err != nil {
		return err
	}
	natSize, err := sizeNATMaps(p.Config.NATMaxEntries, meminfoPath, conntrackMaxPath)
	if err != nil {
		return err
	}
	switch p.Config.TCAttachMode {
	case AttachAuto, AttachTCX, AttachClsact:
	default:
		return fmt.Errorf("--tc-attach-mode=%q: want auto, tcx or clsact", p.Config.TCAttachMode)
	}
	pinDir := p.Agent.PinDir()
	p.Lifecycle.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			note, err := p.Reserve(ports)
			if err != nil {
				return err
			}
			if note != "" {
				p.Log.Info(note)
			}
			p.Log.Info("NAT maps sized", "size", natSize.String())
			nm4, nm6, err := openNonMasq(p.Log, pinDir, p.Agent)
			if err != nil {
				return err
			}
			dp, err := bpf.Load(bpf.LoadOptions{
				PinDir:        pinDir,
				NonMasqV4:     nm4,
				NonMasqV6:     nm6,
				NATMaxEntries: natSize.Entries,
				Logger:        p.Log,
			})
			// The programs hold their own references to the tries.
			closeAll(nm4, nm6)
			if err != nil {
				return err
			}
			if err := dp.SetPortRange(ports.Min, ports.Max); err != nil {
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

	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	_, err = reconciler.Register(
		reconciler.Params{Log: p.Log, DB: p.DB, JobGroup: g, ModuleID: p.ModuleID, DefaultMetrics: p.Metrics},
		p.DPDevices,
		(*tables.DatapathDevice).Clone,
		(*tables.DatapathDevice).SetStatus,
		(*tables.DatapathDevice).GetStatus,
		p.AttachOps,
		nil,
		reconciler.WithName("tc-attach"),
		reconciler.WithPruning(time.Hour),
		reconciler.WithRefreshing(0, nil),
		reconciler.WithRoundLimits(1000, rate.NewLimiter(rate.Inf, 1)),
	)
	if err != nil {
		return err
	}
	if err := registerMapReconcilers(p, g); err != nil {
		return err
	}
	gc := &collector{log: p.Log, dp: p.Handle, lifetimes: lifetimes, snat: func() (map[netip.Addr]bool, bool) {
		return liveSNATAddrs(p.DB, p.NodeAddrs, p.RuleSources)
	}}
	g.Add(job.Timer("nat-gc", gc.collect, p.Config.NATGCInterval))
	return nil
}

// liveSNATAddrs lists the addresses a NAT pair may keep: the node's
// addresses (a flow keeps the address it started with until that address is
// deleted, as with MASQUERADE; adding or reordering addresses changes only
// the choice for new flows) and the masquerade rules' toAddress, once the
// node-addresses table has been derived.
func liveSNATAddrs(db *statedb.DB, nodeAddrs statedb.Table[*tables.NodeAddress],
	rules statedb.Table[*tables.MasqueradeRuleSource]) (map[netip.Addr]bool, bool) {
	txn := db.ReadTxn()
	if init, _ := nodeAddrs.Initialized(txn); !init {
		return nil, false
	}
	out := map[netip.Addr]bool{}
	for a := range nodeAddrs.All(txn) {
		out[a.Addr] = true
	}
	for r := range rules.All(txn) {
		if r.ToAddress.IsValid() {
			out[r.ToAddress] = true
		}
	}
	return out, true
}

// openNonMasq opens the pinned nonmasq tries of the enabled families, the
// ones nonmasqmaps writes (whichever of the two starts first creates them,
// with bpf.NonMasqSpec's layout); a disabled family's trie is nil.
func openNonMasq(log *slog.Logger, pinDir string, agent settings.Config) (v4, v6 *ebpf.Map, err error) {
	if agent.EnableIPv4 {
		if v4, err = bpf.OpenNonMasq(log, pinDir, bpf.MapNonMasqV4, agent.MaxNonMasqCIDRs); err != nil {
			return nil, nil, err
		}
	}
	if agent.EnableIPv6 {
		if v6, err = bpf.OpenNonMasq(log, pinDir, bpf.MapNonMasqV6, agent.MaxNonMasqCIDRs); err != nil {
			closeAll(v4)
			return nil, nil, err
		}
	}
	return v4, v6, nil
}

func closeAll(maps ...*ebpf.Map) {
	for _, m := range maps {
		if m != nil {
			m.Close()
		}
	}
}
