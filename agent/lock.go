package agent

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"

	"github.com/ipmasq/ipmasq/internal/agentlock"
	"github.com/ipmasq/ipmasq/settings"
)

// stateLock holds <state-dir>/agent.lock (internal/agentlock) from the
// first start hook to the last stop hook. A second agent on the node's
// state stops at start with one line naming the holder instead of writing
// the same pins, rules and state file, and `ipmasq-agent uninstall`
// refuses to remove what a running agent uses. It is the first cell of
// Cell, so its start hook runs before any other touches the kernel.
var stateLock = cell.Invoke(func(lc cell.Lifecycle, cfg settings.Config, log *slog.Logger) {
	var l *agentlock.Lock
	lc.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			var err error
			l, err = agentlock.Acquire(cfg.StateDir)
			if errors.Is(err, agentlock.ErrHeld) {
				return fmt.Errorf("--state-dir %s: another ipmasq-agent or an uninstall is running: %w", cfg.StateDir, err)
			}
			if err != nil {
				return fmt.Errorf("--state-dir %s: %w", cfg.StateDir, err)
			}
			log.Debug("State lock taken", "path", agentlock.Path(cfg.StateDir))
			return nil
		},
		OnStop: func(cell.HookContext) error {
			if l == nil {
				return nil
			}
			return l.Release()
		},
	})
})
