package nonmasqmaps

import (
	"cmp"
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/tables"
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

type dumpLine struct {
	prefix netip.Prefix
	action tables.Action
}

func (h *Handle) dump(names ...string) (string, error) {
	if h.maps == nil {
		return "", fmt.Errorf("maps are not open (agent not started)")
	}
	return h.maps.Format(names...)
}

// Format prints the kernel's contents of the maps (all, or those named),
// one "map prefix action" line per entry in prefix order.
func (m *Maps) Format(names ...string) (string, error) {
	want := func(n string) bool { return len(names) == 0 || slices.Contains(names, n) }
	var b strings.Builder
	if m.V4 != nil && want(bpf.MapNonMasqV4) {
		if err := formatMap(&b, bpf.MapNonMasqV4, m.V4); err != nil {
			return "", err
		}
	}
	if m.V6 != nil && want(bpf.MapNonMasqV6) {
		if err := formatMap(&b, bpf.MapNonMasqV6, m.V6); err != nil {
			return "", err
		}
	}
	return b.String(), nil
}

func formatMap[K interface {
	comparable
	Prefix() netip.Prefix
}](b *strings.Builder, name string, m *bpfmap.Map[K, uint8]) error {
	entries, err := m.Dump()
	if err != nil {
		return fmt.Errorf("dump %s: %w", name, err)
	}
	lines := make([]dumpLine, 0, len(entries))
	for k, v := range entries {
		lines = append(lines, dumpLine{k.Prefix(), tables.Action(v)})
	}
	slices.SortFunc(lines, func(a, b dumpLine) int {
		if c := a.prefix.Addr().Compare(b.prefix.Addr()); c != 0 {
			return c
		}
		return cmp.Compare(a.prefix.Bits(), b.prefix.Bits())
	})
	for _, l := range lines {
		fmt.Fprintf(b, "%s %s %s\n", name, l.prefix, l.action)
	}
	return nil
}

func (h *Handle) stats() (string, error) {
	if h.maps == nil {
		return "", fmt.Errorf("maps are not open (agent not started)")
	}
	var b strings.Builder
	if h.maps.V4 != nil {
		s := h.maps.V4.Stats()
		fmt.Fprintf(&b, "%s entries=%d writes=%d deletes=%d\n", bpf.MapNonMasqV4, s.Entries, s.Writes, s.Deletes)
	}
	if h.maps.V6 != nil {
		s := h.maps.V6.Stats()
		fmt.Fprintf(&b, "%s entries=%d writes=%d deletes=%d\n", bpf.MapNonMasqV6, s.Entries, s.Writes, s.Deletes)
	}
	return b.String(), nil
}
