package datapath

import (
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/cells/devices"
	"github.com/ipmasq/ipmasq/internal/faults"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell runs the masquerade datapath. It needs the nonmasq-maps cell (whose
// maps the programs read), the devices cell and the IPAM config (the pod
// CIDRs are the masquerade sources).
var Cell = cell.Module(
	"datapath",
	"eBPF masquerade datapath",

	cell.Config(DefaultConfig),
	cell.Provide(
		newHandle,
		newDatapathDeviceTable,
		statedb.RWTable[*tables.DatapathDevice].ToTable,
		newMasqueradeRuleSourceTable,
		statedb.RWTable[*tables.MasqueradeRuleSource].ToTable,
		scriptCommands,
	),
	cell.Invoke(register),
)

func newDatapathDeviceTable(db *statedb.DB) (statedb.RWTable[*tables.DatapathDevice], error) {
	return tables.NewDatapathDeviceTable(db)
}

func newMasqueradeRuleSourceTable(db *statedb.DB) (statedb.RWTable[*tables.MasqueradeRuleSource], error) {
	return tables.NewMasqueradeRuleSourceTable(db)
}

type params struct {
	cell.In

	Log         *slog.Logger
	DB          *statedb.DB
	Jobs        job.Registry
	Health      cell.Health
	ModuleID    cell.FullModuleID
	Lifecycle   cell.Lifecycle
	Agent       settings.Config
	PodCIDRs    statedb.Table[*tables.PodCIDR]
	Config      Config
	NonMasq     *nonmasqmaps.Handle
	Devices     statedb.Table[*tables.EgressDevice]
	Rules       statedb.Table[*tables.MasqueradeRule]
	DPDevices   statedb.RWTable[*tables.DatapathDevice]
	RuleSources statedb.RWTable[*tables.MasqueradeRuleSource]
	Handle      *Handle
	// Netns is the namespace of the devices (tests); nil: the agent's own.
	Netns *devices.Netns `optional:"true"`
	// Metrics is the hive's reconciler metrics, when it has any.
	Metrics reconciler.Metrics `optional:"true"`
	// Faults injects attach and rule map write failures (tests only).
	Faults *faults.Injector `optional:"true"`
}

func register(p params) error {
	ports, err := ParsePortRange("--nat-port-range", p.Config.NATPortRange)
	if err != nil {
		return err
	}
	sources := podCIDRs(tables.PodCIDRPrefixes(p.DB.ReadTxn(), p.PodCIDRs), p.Agent)
	switch p.Config.TCAttachMode {
	case AttachAuto, AttachTCX, AttachClsact:
	default:
		return fmt.Errorf("--tc-attach-mode=%q: want auto, tcx or clsact", p.Config.TCAttachMode)
	}
	pinDir := p.Agent.PinDir()
	p.Lifecycle.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			var note string
			if err := p.Netns.Do(func() (err error) { note, err = reserveNATPorts(ports); return err }); err != nil {
				return err
			}
			if note != "" {
				p.Log.Info(note)
			}
			maps := p.NonMasq.Maps()
			dp, err := bpf.Load(bpf.LoadOptions{
				PinDir:        pinDir,
				NonMasqV4:     maps.RawV4(),
				NonMasqV6:     maps.RawV6(),
				NATMaxEntries: p.Config.NATMaxEntries,
				Logger:        p.Log,
			})
			if err != nil {
				return err
			}
			if err := dp.SetPortRange(ports.Min, ports.Max); err != nil {
				dp.Close()
				return err
			}
			if err := syncSources(dp, sources); err != nil {
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

	wtxn := p.DB.WriteTxn(p.DPDevices, p.RuleSources)
	markDevices := p.DPDevices.RegisterInitializer(wtxn, "datapath")
	markSources := p.RuleSources.RegisterInitializer(wtxn, "datapath")
	wtxn.Commit()
	markInit := func(wtxn statedb.WriteTxn) {
		markDevices(wtxn)
		markSources(wtxn)
	}

	g := p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log))
	_, err = reconciler.Register(
		reconciler.Params{Log: p.Log, DB: p.DB, JobGroup: g, ModuleID: p.ModuleID, DefaultMetrics: p.Metrics},
		p.DPDevices,
		(*tables.DatapathDevice).Clone,
		(*tables.DatapathDevice).SetStatus,
		(*tables.DatapathDevice).GetStatus,
		faults.Wrap[*tables.DatapathDevice](p.Faults, faults.TCAttach,
			&attachOps{linkDir: filepath.Join(pinDir, "links"), dp: p.Handle, netns: p.Netns, mode: p.Config.TCAttachMode}),
		nil,
		reconciler.WithName("tc-attach"),
		reconciler.WithPruning(time.Hour),
		reconciler.WithRefreshing(0, nil),
		reconciler.WithRoundLimits(1000, rate.NewLimiter(rate.Inf, 1)),
	)
	if err != nil {
		return err
	}
	d := &deriver{params: p, markInitialized: markInit}
	g.Add(job.OneShot("derive-devices", d.run))
	if err := registerMasqueradeRuleSources(p, g); err != nil {
		return err
	}
	gc := &collector{log: p.Log, dp: p.Handle, snat: func() (map[netip.Addr]bool, bool) {
		return currentSNAT(p.DB, p.DPDevices, p.RuleSources)
	}}
	g.Add(job.Timer("nat-gc", gc.collect, p.Config.NATGCInterval))
	return nil
}

// podCIDRs are the masquerade sources of the enabled families.
func podCIDRs(cidrs []netip.Prefix, agent settings.Config) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range cidrs {
		if (p.Addr().Is4() && agent.EnableIPv4) || (p.Addr().Is6() && agent.EnableIPv6) {
			out = append(out, p.Masked())
		}
	}
	return out
}

// syncSources makes masq_src_v4/v6 hold exactly the sources.
func syncSources(dp *bpf.Datapath, sources []netip.Prefix) error {
	v4, err := bpfmap.NewMap[bpfmap.LPMKeyV4, uint8](dp.Maps.MasqSrcV4)
	if err != nil {
		return err
	}
	v6, err := bpfmap.NewMap[bpfmap.LPMKeyV6, uint8](dp.Maps.MasqSrcV6)
	if err != nil {
		return err
	}
	want4, want6 := map[bpfmap.LPMKeyV4]uint8{}, map[bpfmap.LPMKeyV6]uint8{}
	for _, p := range sources {
		if p.Addr().Is4() {
			want4[bpfmap.LPMKeyV4From(p)] = 1
		} else {
			want6[bpfmap.LPMKeyV6From(p)] = 1
		}
	}
	if err := syncMap(v4, want4); err != nil {
		return fmt.Errorf("%s: %w", bpf.MapMasqSrcV4, err)
	}
	if err := syncMap(v6, want6); err != nil {
		return fmt.Errorf("%s: %w", bpf.MapMasqSrcV6, err)
	}
	return nil
}

// syncMap makes m hold exactly want, writing only the difference.
func syncMap[K comparable](m *bpfmap.Map[K, uint8], want map[K]uint8) error {
	kvs := make([]bpfmap.KV[K, uint8], 0, len(want))
	for k, v := range want {
		kvs = append(kvs, bpfmap.KV[K, uint8]{Key: k, Value: v})
	}
	return m.Sync(kvs)
}

// syncNodeAddrs writes every address of every device into node_addrs: such
// destinations are the node itself and are never masqueraded.
func (d *deriver) syncNodeAddrs(devs []*tables.EgressDevice) error {
	dp := d.params.Handle.get()
	if dp == nil {
		return ErrNotLoaded
	}
	if d.nodeV4 == nil {
		var err error
		if d.nodeV4, err = bpfmap.NewMap[uint32, uint8](dp.Maps.NodeAddrsV4); err != nil {
			return err
		}
		if d.nodeV6, err = bpfmap.NewMap[[16]byte, uint8](dp.Maps.NodeAddrsV6); err != nil {
			return err
		}
	}
	want4, want6 := map[uint32]uint8{}, map[[16]byte]uint8{}
	for _, dev := range devs {
		for _, a := range dev.Addresses {
			if a.Is4() {
				want4[bpf.Addr4(a)] = 1
			} else {
				want6[a.As16()] = 1
			}
		}
	}
	if err := syncMap(d.nodeV4, want4); err != nil {
		return err
	}
	return syncMap(d.nodeV6, want6)
}

// currentSNAT lists the SNAT addresses in use: the datapath devices' and
// the masquerade rules' toAddress, once the tables have been derived.
func currentSNAT(db *statedb.DB, tbl statedb.Table[*tables.DatapathDevice], rules statedb.Table[*tables.MasqueradeRuleSource]) (map[netip.Addr]bool, bool) {
	txn := db.ReadTxn()
	if init, _ := tbl.Initialized(txn); !init {
		return nil, false
	}
	out := map[netip.Addr]bool{}
	for d := range tbl.All(txn) {
		if d.SNATv4.IsValid() {
			out[d.SNATv4] = true
		}
		if d.SNATv6.IsValid() {
			out[d.SNATv6] = true
		}
	}
	for r := range rules.All(txn) {
		if r.ToAddress.IsValid() {
			out[r.ToAddress] = true
		}
	}
	return out, true
}
