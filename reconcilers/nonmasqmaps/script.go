package nonmasqmaps

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/ipmasq/ipmasq/bpf"
)

// scriptCommands are the shell and script-test commands of this cell:
//
//	maps/dump    the kernel's view of nonmasq_v4 and nonmasq_v6
//	maps/stats   entries and writes per map since the agent started
//	maps/resync  compare the maps with the table now and repair drift
func scriptCommands(h *Handle) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"maps/dump": script.Command(
			script.CmdUsage{
				Summary: "Dump the pinned non-masquerade maps as the kernel holds them",
				Args:    "[nonmasq_v4|nonmasq_v6]",
				Detail: []string{
					"One line per entry: map name, prefix, action. Waits first until",
					"the reconciler has processed every table change made so far.",
				},
			},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				ctx, cancel := context.WithTimeout(s.Context(), 5*time.Second)
				defer cancel()
				if err := h.WaitReconciled(ctx); err != nil {
					return nil, fmt.Errorf("wait for reconciliation: %w", err)
				}
				return func(*script.State) (string, string, error) {
					out, err := h.dump(args...)
					return out, "", err
				}, nil
			}),
		"maps/resync": script.Command(
			script.CmdUsage{Summary: "Compare the maps with the table now: prune stale entries, repair changed ones"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if h.r == nil {
					return nil, fmt.Errorf("reconciler not registered")
				}
				h.r.Prune()
				return nil, nil
			}),
		"maps/stats": script.Command(
			script.CmdUsage{Summary: "Show entries, entry writes and deletes per non-masquerade map since start"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				return func(*script.State) (string, string, error) {
					out, err := h.stats()
					return out, "", err
				}, nil
			}),
	})
}

func (h *Handle) dump(names ...string) (string, error) {
	if h.Maps() == nil {
		return "", fmt.Errorf("maps are not loaded (agent not started)")
	}
	return Format(bpf.Pinned{Dir: h.pinDir}, names...)
}

func (h *Handle) stats() (string, error) {
	maps := h.Maps()
	if maps == nil {
		return "", fmt.Errorf("maps are not loaded (agent not started)")
	}
	var b strings.Builder
	if maps.V4 != nil {
		s := maps.V4.Stats()
		fmt.Fprintf(&b, "%s entries=%d writes=%d deletes=%d\n", bpf.MapNonMasqV4, s.Entries, s.Writes, s.Deletes)
	}
	if maps.V6 != nil {
		s := maps.V6.Stats()
		fmt.Fprintf(&b, "%s entries=%d writes=%d deletes=%d\n", bpf.MapNonMasqV6, s.Entries, s.Writes, s.Deletes)
	}
	return b.String(), nil
}
