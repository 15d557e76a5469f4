package config

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ipmasq/ipmasq/tables"
)

// DropInPrefix starts the name of every file beside the config file that
// is merged with it, as Azure's ip-masq-agent-v2 (AKS) reads every file of
// its config folder whose name starts with "ip-masq" (one ConfigMap of the
// cluster's own, one the cloud provider reconciles, projected into one
// folder).
const DropInPrefix = "ip-masq"

// tempSuffixes end the names of files that are an editor's or an atomic
// writer's temporary or backup (ip-masq-agent-x.tmp renamed over
// ip-masq-agent-x, an editor's ip-masq-agent-x~): never merged, though
// their names start with DropInPrefix, since a half-written one would be
// applied for a moment. ip-masq-agent-v2 reads them too.
var tempSuffixes = []string{"~", ".tmp", ".swp", ".bak", ".orig", ".old", ".new", ".dpkg-old", ".dpkg-new", ".rpmnew", ".rpmsave"}

// isDropIn reports whether name, an entry of the config file's directory,
// is merged with the config file named main. Names of the config file's
// own with an extension (ip-masq-agent.tmp, ip-masq-agent.swap) are its
// writers' temporaries, not drop-ins.
func isDropIn(name, main string) bool {
	if name == main || !strings.HasPrefix(name, DropInPrefix) || strings.HasPrefix(name, main+".") {
		return false
	}
	for _, s := range tempSuffixes {
		if strings.HasSuffix(name, s) {
			return false
		}
	}
	return true
}

// namedFile is one file's good content, by path.
type namedFile struct {
	path string
	p    *parsed
}

// merge combines the contents of files, in name order, as
// ip-masq-agent-v2 merges them, and returns the File, its entries and what
// an operator should hear about. One file is its own content, as parse
// read it (with Limits.V2, v2's reading: no key, no defaults). Several:
//
//   - nonMasqueradeCIDRs: the union of every file's list. As in v2 the
//     defaults apply only when there is no file at all: a file without the
//     key adds nothing.
//   - masqLinkLocal, masqLinkLocalIPv6: true when any file says true.
//   - ipmasq's own keys: masqueradeCIDRs the union (a prefix another file
//     lists in nonMasqueradeCIDRs stays unmasqueraded, the rule v2 would
//     apply); resyncInterval the shortest; masqueradeRules every file's,
//     a name used twice keeping the first file's rule; cidrLimit is each
//     file's own.
//
// Each resolved disagreement, and each unknown key, is a warning naming the
// files. The error is the merged map capacity being exceeded.
func merge(files []namedFile, lim Limits) (*File, []Entry, []tables.ConfigWarning, error) {
	if len(files) == 1 {
		p := files[0].p
		return p.file, p.entries, p.warnings, nil
	}
	f := &File{NonMasqueradeCIDRsSet: true, NonMasqueradeCIDRs: []netip.Prefix{}}
	var warnings []tables.ConfigWarning
	conflict := func(format string, args ...any) {
		warnings = append(warnings, tables.ConfigWarning{Kind: tables.ConfigWarningConflict, Message: fmt.Sprintf(format, args...)})
	}
	names := make([]string, len(files))
	for i, nf := range files {
		names[i] = nf.path
		warnings = append(warnings, nf.p.warnings...)
	}

	// nonMasqueradeCIDRs, and which file listed each first.
	nonMasqFrom := map[netip.Prefix]string{}
	for _, nf := range files {
		for _, p := range nf.p.file.NonMasqueradeCIDRs {
			if _, ok := nonMasqFrom[p]; !ok {
				nonMasqFrom[p] = nf.path
				f.NonMasqueradeCIDRs = append(f.NonMasqueradeCIDRs, p)
			}
		}
	}
	f.NonMasqueradeCIDRs = sortCompact(f.NonMasqueradeCIDRs)
	seenMasq := map[netip.Prefix]bool{}
	for _, nf := range files {
		for _, p := range nf.p.file.MasqueradeCIDRs {
			if other, ok := nonMasqFrom[p]; ok {
				conflict("%s: masqueradeCIDRs lists %s, which %s lists in nonMasqueradeCIDRs; it is not masqueraded (the nonMasqueradeCIDRs of every merged file apply)",
					nf.path, p, other)
				continue
			}
			if !seenMasq[p] {
				seenMasq[p] = true
				f.MasqueradeCIDRs = append(f.MasqueradeCIDRs, p)
			}
		}
	}
	f.MasqueradeCIDRs = sortCompact(f.MasqueradeCIDRs)
	if len(f.MasqueradeCIDRs) == 0 {
		f.MasqueradeCIDRs = nil
	}

	f.MasqLinkLocal = mergeLinkLocal(files, "masqLinkLocal", "169.254.0.0/16",
		func(p *parsed) (bool, bool) { return p.file.MasqLinkLocal, p.linkLocalSet }, conflict)
	f.MasqLinkLocalIPv6 = mergeLinkLocal(files, "masqLinkLocalIPv6", "fe80::/10",
		func(p *parsed) (bool, bool) { return p.file.MasqLinkLocalIPv6, p.linkLocalV6Set }, conflict)

	var resyncs []string
	for _, nf := range files {
		if d := nf.p.file.ResyncInterval; d > 0 {
			if f.ResyncInterval == 0 || d < f.ResyncInterval {
				f.ResyncInterval = d
			}
			resyncs = append(resyncs, fmt.Sprintf("%s in %s", d, nf.path))
		}
	}
	if len(resyncs) > 1 && slices.ContainsFunc(files, func(nf namedFile) bool {
		d := nf.p.file.ResyncInterval
		return d > 0 && d != f.ResyncInterval
	}) {
		conflict("resyncInterval: %s; the shortest, %s, is used", strings.Join(resyncs, ", "), f.ResyncInterval)
	}

	ruleFrom := map[string]string{}
	byName := map[string]*tables.MasqueradeRule{}
	for _, nf := range files {
		for _, r := range nf.p.file.MasqueradeRules {
			if prev, ok := byName[r.Name]; ok {
				if !sameRule(prev, &r) {
					conflict("%s: masqueradeRules: rule %s differs from the rule of that name in %s; the rule of %s is used",
						nf.path, quote(r.Name), ruleFrom[r.Name], ruleFrom[r.Name])
				}
				continue
			}
			ruleFrom[r.Name] = nf.path
			f.MasqueradeRules = append(f.MasqueradeRules, r)
			byName[r.Name] = &f.MasqueradeRules[len(f.MasqueradeRules)-1]
		}
	}

	entries := f.Entries(lim)
	if err := checkCapacity(strings.Join(names, " + "), f, lim, entries); err != nil {
		return nil, nil, nil, err
	}
	return f, entries, warnings, nil
}

// mergeLinkLocal ORs one link-local key over files, with a conflict when
// one file sets it true and another explicitly false.
func mergeLinkLocal(files []namedFile, key, prefix string, get func(*parsed) (value, set bool),
	conflict func(string, ...any)) bool {
	var on, off []string
	for _, nf := range files {
		switch v, set := get(nf.p); {
		case v:
			on = append(on, nf.path)
		case set:
			off = append(off, nf.path)
		}
	}
	if len(on) > 0 && len(off) > 0 {
		conflict("%s: true in %s, false in %s; %s is masqueraded (true in any merged file wins)",
			key, strings.Join(on, ", "), strings.Join(off, ", "), prefix)
	}
	return len(on) > 0
}

// unknownKeyWarnings names each unknown key of f (read from path) and the
// known key nearest to it.
func unknownKeyWarnings(path string, f *File) []tables.ConfigWarning {
	var out []tables.ConfigWarning
	for _, k := range f.UnknownKeys {
		hint := ""
		if s := closestKeyIn(k, jsonKeys[rawFile]()); s != "" {
			hint = fmt.Sprintf("did you mean %s? ", s)
		}
		out = append(out, tables.ConfigWarning{Kind: tables.ConfigWarningUnknownKey,
			Message: fmt.Sprintf("%s: unknown key %s ignored (%sknown keys: %s)", path, quote(k), hint, topLevelKeys)})
	}
	return out
}
