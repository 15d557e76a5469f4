package nonmasqmaps

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/tables"
)

// Maps are the nonmasq tries of the loaded datapath, with the in-memory
// copy the reconciler writes through (bpfmap.Ops reads their contents when
// it opens them, so that a restart writes only what differs); a map is nil
// when its family is disabled (no row of that family can exist: the config
// refuses it).
type Maps struct {
	V4 *bpfmap.Map[bpf.LPMKeyV4, uint8]
	V6 *bpfmap.Map[bpf.LPMKeyV6, uint8]
}

// Format prints the kernel's contents of the pinned tries (all, or those
// named), one "map prefix action" line per entry in prefix order, as
// `ipmasq-agent maps` and the shell's maps/dump show them. It reads the
// pins (bpf.Pinned), so it needs no running agent; a trie that is not
// pinned prints nothing, and if none is the error says so.
func Format(p bpf.Pinned, names ...string) (string, error) {
	if len(names) == 0 {
		names = []string{bpf.MapNonMasqV4, bpf.MapNonMasqV6}
	}
	var b strings.Builder
	found := false
	for _, name := range names {
		entries, err := p.NonMasq(name)
		if err != nil {
			if errors.Is(err, bpf.ErrNotPinned) {
				continue
			}
			return "", err
		}
		found = true
		lines := make([]dumpLine, 0, len(entries))
		for prefix, v := range entries {
			lines = append(lines, dumpLine{prefix, tables.Action(v)})
		}
		slices.SortFunc(lines, func(a, b dumpLine) int {
			if c := a.prefix.Addr().Compare(b.prefix.Addr()); c != 0 {
				return c
			}
			return cmp.Compare(a.prefix.Bits(), b.prefix.Bits())
		})
		for _, l := range lines {
			fmt.Fprintf(&b, "%s %s %s\n", name, l.prefix, l.action)
		}
	}
	if !found {
		return "", fmt.Errorf("no ipmasq maps pinned in %s (is the agent's --bpf-root the same?)", p.Dir)
	}
	return b.String(), nil
}

type dumpLine struct {
	prefix netip.Prefix
	action tables.Action
}
