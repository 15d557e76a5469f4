package handover

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/tables"
)

// Cell runs the handover (job conntrack-handover) while the
// netfilter-nat-rules table is not empty, and provides the
// conntrack-handover table (its state and counts) and the
// datapath/handover command. It needs
// datapath.Cell and the netfilter-nat-rules and node-addresses tables.
var Cell = cell.Group(
	cell.Config(Config{ConntrackHandover: true}),
	cell.ProvidePrivate(tables.NewHandoverTable),
	cell.Provide(
		newHandover, scriptCommands,
		statedb.RWTable[*tables.Handover].ToTable,
	),
	cell.Invoke(register),
)

// Config is the handover's flag.
type Config struct {
	// ConntrackHandover turns the handover on.
	ConntrackHandover bool
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Bool("conntrack-handover", def.ConntrackHandover,
		"While a netfilter NAT rule decides before ipmasq (a migration from or back to the Kubernetes ip-masq-agent), adopt conntrack's masquerade bindings as NAT pairs and hand the datapath's pairs back to conntrack, so that established flows keep their translation (docs/migrate.md)")
}

// handBackInterval is how often the pairs made since the last pass are
// handed back while a rule decides before ipmasq; at least ten times as
// long as a pass took (a pass reads the NAT maps whole, a cost that grows
// with the flows), so that it takes at most a tenth of a CPU.
const handBackInterval = time.Second

// Handover is the running handover: see the package doc.
type Handover struct {
	in params // what the hive injected

	mu        sync.Mutex
	mover     *mover // for the loaded datapath; nil until it is
	active    bool
	available bool
}

type params struct {
	cell.In

	Config    Config
	Log       *slog.Logger
	DB        *statedb.DB
	Handle    *datapath.Handle
	Rules     statedb.Table[*tables.NetfilterNATRule]
	NodeAddrs statedb.Table[*tables.NodeAddress]
	Table     statedb.RWTable[*tables.Handover]
}

func newHandover(p params) *Handover {
	return &Handover{in: p}
}

func register(jobs job.Registry, health cell.Health, log *slog.Logger, h *Handover) {
	g := jobs.NewGroup(health, job.WithLogger(log))
	g.Add(job.OneShot("conntrack-handover", h.run))
}

// row is the table row of the handover now.
func (h *Handover) row() *tables.Handover {
	h.mu.Lock()
	defer h.mu.Unlock()
	var r tables.Handover
	if h.mover != nil {
		h.mover.mu.Lock()
		r = h.mover.stats
		h.mover.mu.Unlock()
	}
	r.Enabled, r.Active, r.Available = h.in.Config.ConntrackHandover, h.active, h.available
	return &r
}

// publish writes the row if it changed.
func (h *Handover) publish() {
	r := h.row()
	txn := h.in.DB.WriteTxn(h.in.Table)
	defer txn.Abort()
	if old := tables.HandoverRow(txn, h.in.Table); old != nil && *old == *r {
		return
	}
	h.in.Table.Insert(txn, r)
	txn.Commit()
}

// run follows the netfilter-nat-rules table: while it has a row, it
// adopts conntrack's bindings (a dump, then NEW events) and hands the
// pairs back every handBackInterval.
func (h *Handover) run(ctx context.Context, health cell.Health) error {
	available, err := bpf.ConntrackLookupAvailable()
	if err != nil {
		h.in.Log.Warn("Cannot tell whether the kernel has the conntrack lookup for BPF; no flow handover", "error", err)
	}
	h.mu.Lock()
	h.available = available
	h.mu.Unlock()
	var (
		stop func()
		cur  *mover // the mover the listener adopts for
		wait = handBackInterval
	)
	defer func() {
		if stop != nil {
			stop()
			cur.close()
		}
	}()
	for {
		rows, watch := h.in.Rules.AllWatch(h.in.DB.ReadTxn())
		want := h.in.Config.ConntrackHandover && len(tables.NetfilterNATRules(rows)) > 0 && available
		m := h.moverFor()
		if stop != nil && (!want || m != cur) {
			// No rule decides before ipmasq any more, or the datapath
			// was loaded again.
			h.in.Log.Info("Flow handover stopped", "status", h.row().Describe())
			stop()
			cur.close()
			stop, cur = nil, nil
		}
		if want && m != nil && stop == nil {
			h.in.Log.Info("A netfilter NAT rule decides before ipmasq: adopting conntrack's masquerade bindings and handing pairs back to conntrack (docs/migrate.md)")
			if stop, err = h.listen(ctx, m); err != nil {
				health.Degraded("adopt conntrack's bindings", err)
				stop = nil
			} else {
				cur = m
			}
		}
		h.mu.Lock()
		h.active = stop != nil
		h.mu.Unlock()
		if stop != nil {
			start := time.Now()
			n, err := m.handBackAll()
			wait = max(handBackInterval, 10*time.Since(start))
			if err != nil {
				health.Degraded("hand pairs back to conntrack", err)
			} else {
				if n > 0 {
					h.in.Log.Info("Pairs handed back to conntrack", "count", n)
				}
				health.OK("handover active")
			}
		} else {
			health.OK("handover idle")
		}
		h.publish()
		// Idle, only a change of the rules (or the datapath's first load)
		// wakes the job.
		var tick <-chan time.Time
		if stop != nil || (want && m == nil) {
			tick = time.After(wait)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case <-tick:
		}
	}
}

// moverFor returns the mover of the loaded datapath (nil before it loads).
func (h *Handover) moverFor() *mover {
	dp := h.in.Handle.Get()
	h.mu.Lock()
	defer h.mu.Unlock()
	if dp == nil {
		return nil
	}
	if h.mover == nil || h.mover.dp != dp {
		h.mover = &mover{log: h.in.Log, dp: dp, forwarded: func(a netip.Addr) bool { return !h.isNodeAddr(a) }, nodeAddr: h.isNodeAddr}
	}
	return h.mover
}

func (h *Handover) isNodeAddr(a netip.Addr) bool {
	_, _, found := h.in.NodeAddrs.Get(h.in.DB.ReadTxn(), tables.NodeAddressByAddr.Query(a))
	return found
}

// listen subscribes to conntrack's NEW events, then adopts every binding
// of a dump (subscribed first, so that no flow falls between the two), and
// adopts each new one until stop is called.
func (h *Handover) listen(ctx context.Context, m *mover) (stop func(), err error) {
	events, err := conntrack.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("open ctnetlink: %w", err)
	}
	// Room for a burst of new flows: an overrun drops events, and is
	// caught up by a dump.
	if err := events.SetReadBuffer(8 << 20); err != nil {
		h.in.Log.Debug("Cannot enlarge the conntrack event buffer", "error", err)
	}
	ch := make(chan conntrack.Event, 1024)
	errs, err := events.Listen(ch, 1, []netfilter.NetlinkGroup{netfilter.GroupCTNew})
	if err != nil {
		events.Close()
		return nil, fmt.Errorf("listen to conntrack events: %w", err)
	}
	if err := h.adoptDump(m); err != nil {
		events.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case ev := <-ch:
				if ev.Flow != nil {
					m.adopt(*ev.Flow)
				}
			case err := <-errs:
				if err == nil || ctx.Err() != nil {
					return
				}
				// Events were lost (the socket's buffer overran): a dump
				// has every binding still there.
				h.in.Log.Warn("Conntrack events lost; reading the table again", "error", err)
				if err := h.adoptDump(m); err != nil {
					h.in.Log.Warn("Cannot read conntrack's table", "error", err)
				}
			}
		}
	}()
	return func() {
		cancel()
		events.Close()
		wg.Wait()
	}, nil
}

func (h *Handover) adoptDump(m *mover) error {
	c, err := conntrack.Dial(nil)
	if err != nil {
		return fmt.Errorf("open ctnetlink: %w", err)
	}
	defer c.Close()
	flows, err := c.Dump(nil)
	if err != nil {
		return fmt.Errorf("read conntrack's table: %w", err)
	}
	for _, f := range flows {
		m.adopt(f)
	}
	return nil
}

// scriptCommands are the shell and script-test commands of the handover:
//
//	datapath/handover   print the handover's state and counts
func scriptCommands(h *Handover) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"datapath/handover": script.Command(
			script.CmdUsage{Summary: "The flow handover between conntrack and ipmasq (docs/migrate.md): state and counts"},
			func(*script.State, ...string) (script.WaitFunc, error) {
				out := h.row().Describe() + "\n"
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
	})
}
