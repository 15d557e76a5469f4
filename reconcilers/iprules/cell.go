package iprules

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/vishvananda/netns"
	"golang.org/x/time/rate"

	"github.com/ipmasq/ipmasq/tables"
)

// Cell registers the reconciler that writes the ip-rules table into the
// kernel. It writes through the Target in the hive when there is one (tests,
// a bigger agent with its own netlink handle), else through netlink in the
// agent's network namespace.
var Cell = cell.Module(
	"ip-rules",
	"Writes the per-endpoint ip rules into the kernel",

	cell.ProvidePrivate(newOps),
	// The Operations the reconciler runs, in the hive so that tests
	// decorate them (fault injection) the way statedb's example does.
	cell.Provide(func(o *Ops) reconciler.Operations[*tables.IPRule] { return o }),
	cell.Provide(newHandle, scriptCommands),
	cell.Invoke(register),
)

// Handle gives script commands and other cells access to the reconciler.
type Handle struct {
	ops   *Ops
	r     reconciler.Reconciler[*tables.IPRule]
	db    *statedb.DB
	rules statedb.Table[*tables.IPRule]
}

func newHandle(o *Ops) *Handle { return &Handle{ops: o} }

// Stats returns the owned rule count and writes since start.
func (h *Handle) Stats() Stats { return h.ops.Stats() }

// WaitReconciled waits until the reconciler has processed every change of
// the ip-rules table up to now (successfully or not).
func (h *Handle) WaitReconciled(ctx context.Context) error {
	if h.r == nil {
		return errors.New("ip rule reconciler not registered")
	}
	_, _, err := h.r.WaitUntilReconciled(ctx, h.rules.Revision(h.db.ReadTxn()))
	return err
}

type opsParams struct {
	cell.In

	Lifecycle cell.Lifecycle
	Target    Target `optional:"true"`
}

func newOps(p opsParams) (*Ops, error) {
	if p.Target != nil {
		return NewOps(p.Target), nil
	}
	t, err := NewNetlinkTargetAt(netns.None())
	if err != nil {
		return nil, fmt.Errorf("ip rules: %w", err)
	}
	p.Lifecycle.Append(cell.Hook{OnStop: func(cell.HookContext) error { return t.Close() }})
	return NewOps(t), nil
}

type registerParams struct {
	cell.In

	Log      *slog.Logger
	DB       *statedb.DB
	Jobs     job.Registry
	Health   cell.Health
	ModuleID cell.FullModuleID
	Rules    statedb.RWTable[*tables.IPRule]
	Ops      reconciler.Operations[*tables.IPRule]
	Handle   *Handle
	// Metrics is the hive's reconciler metrics, when it has any.
	Metrics reconciler.Metrics `optional:"true"`
}

func register(p registerParams) error {
	// Batched writes when the Operations have them; a test double that
	// decorates Ops without them gets every write through Update/Delete.
	batch, _ := p.Ops.(reconciler.BatchOperations[*tables.IPRule])
	r, err := reconciler.Register(
		reconciler.Params{
			Log:      p.Log,
			DB:       p.DB,
			JobGroup: p.Jobs.NewGroup(p.Health, job.WithLogger(p.Log)),
			ModuleID: p.ModuleID,

			DefaultMetrics: p.Metrics,
		},
		p.Rules,
		(*tables.IPRule).Clone,
		(*tables.IPRule).SetStatus,
		(*tables.IPRule).GetStatus,
		p.Ops, batch,
		reconciler.WithName("ip-rules"),
		// Prune once the rules controller has derived the full set (it
		// marks the table initialized), then hourly to repair drift.
		reconciler.WithPruning(time.Hour),
		// The cache makes refreshes free; drift is found by pruning.
		reconciler.WithRefreshing(0, nil),
		reconciler.WithRoundLimits(10000, rate.NewLimiter(rate.Inf, 1)),
	)
	p.Handle.r, p.Handle.db, p.Handle.rules = r, p.DB, p.Rules
	return err
}

// scriptCommands are the shell and script-test commands of this cell:
//
//	rules/dump   the owned rules as the target (kernel) holds them
//	rules/stats  owned rules, adds and deletes since start
func scriptCommands(h *Handle) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"rules/dump": script.Command(
			script.CmdUsage{
				Summary: "List the ip rules owned by ipmasq as the kernel holds them, like `ip rule`",
				Detail:  []string{"Waits first until the reconciler has processed every table change made so far."},
			},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				ctx, cancel := context.WithTimeout(s.Context(), 5*time.Second)
				defer cancel()
				if err := h.WaitReconciled(ctx); err != nil {
					return nil, fmt.Errorf("wait for reconciliation: %w", err)
				}
				keys, err := h.ops.target.List()
				if err != nil {
					return nil, err
				}
				return func(*script.State) (string, string, error) { return Format(keys), "", nil }, nil
			}),
		"rules/stats": script.Command(
			script.CmdUsage{Summary: "Show the number of owned rules and the rule writes since start"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				st := h.Stats()
				out := fmt.Sprintf("rules=%d adds=%d deletes=%d\n", st.Rules, st.Adds, st.Deletes)
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
	})
}

// Format prints rules the way `ip rule` does, sorted by priority.
func Format(keys []tables.IPRuleKey) string {
	keys = slices.Clone(keys)
	slices.SortFunc(keys, CompareKeys)
	var b strings.Builder
	for _, k := range keys {
		from := k.From.String()
		if k.From.IsSingleIP() {
			from = k.From.Addr().String()
		}
		if k.From.Bits() == 0 {
			from = "all"
		}
		fmt.Fprintf(&b, "%d: from %s to %s lookup %s\n", k.Priority, from, k.To, tableName(k.Table))
	}
	return b.String()
}

func tableName(t uint32) string {
	if t == tables.MainRouteTable {
		return "main"
	}
	return fmt.Sprint(t)
}
