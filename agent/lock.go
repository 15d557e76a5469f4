package agent

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"

	"github.com/ipmasq/ipmasq/cells/api"
	"github.com/ipmasq/ipmasq/internal/agentlock"
	"github.com/ipmasq/ipmasq/internal/unixsock"
	"github.com/ipmasq/ipmasq/readers/shell"
	"github.com/ipmasq/ipmasq/settings"
)

// stateLock holds <state-dir>/agent.lock (internal/agentlock) from the
// first start hook to the last stop hook. A second agent on the node's
// state stops at start with one line naming the holder instead of writing
// the same pins, rules and state file, and `ipmasq-agent uninstall`
// refuses to remove what a running agent uses. It is the first cell of
// Cell, so its start hook runs before any other touches the kernel.
//
// The sockets' own locks (internal/unixsock) are checked here too: an
// agent on another --state-dir but a socket path a running agent serves
// stops before it loads or attaches anything, not at its API's start hook
// after its datapath has touched the node.
var stateLock = cell.Invoke(func(lc cell.Lifecycle, cfg settings.Config, apiCfg api.Config, shellCfg shell.Config, log *slog.Logger) {
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
			for _, s := range []struct{ flag, path string }{{"--api-socket", apiCfg.APISocket}, {"--" + shell.SocketFlag, shellCfg.ShellSockPath}} {
				if s.path != "" && unixsock.Held(s.path) {
					l.Release()
					l = nil
					return fmt.Errorf("%s %s: %w", s.flag, s.path, unixsock.ErrInUse)
				}
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
