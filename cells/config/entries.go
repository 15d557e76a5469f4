package config

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/ipmasq/ipmasq/tables"
)

// entryRank orders rows for the same prefix: the first one is kept.
// An explicit masqueradeCIDRs entry beats everything, an explicit
// nonMasqueradeCIDRs entry beats the implied link-local and default rows.
func entryRank(e Entry) int {
	switch {
	case e.Action == tables.ActionMasquerade:
		return 0
	case e.Origin == tables.OriginConfig:
		return 1
	case e.Origin == tables.OriginLinkLocal:
		return 2
	}
	return 3
}

// Entries computes the desired nonmasq-cidrs rows for f (f == nil means no
// file: defaults). It applies the defaults (OriginDefault:
// DefaultNonMasqueradeCIDRs, or ReservedNonMasqueradeCIDRs with
// lim.AllReservedRanges) when NonMasqueradeCIDRsSet is false; adds 169.254.0.0/16 unless MasqLinkLocal
// and fe80::/10 unless MasqLinkLocalIPv6 (OriginLinkLocal; a prefix the
// user listed explicitly keeps OriginConfig); and adds masqueradeCIDRs as
// ActionMasquerade/OriginConfig, which override a default or link-local
// row for the same prefix. Only the families enabled in lim are included.
// The result is sorted by prefix (netip.Prefix.Compare) with no duplicates.
func (f *File) Entries(lim Limits) []Entry {
	if f == nil {
		f = &File{}
	}
	out := make([]Entry, 0, len(f.NonMasqueradeCIDRs)+len(f.MasqueradeCIDRs)+len(ReservedNonMasqueradeCIDRs)+2)
	add := func(p netip.Prefix, a tables.Action, o tables.Origin) {
		if !p.IsValid() || !familyEnabled(p.Addr(), lim) {
			return
		}
		out = append(out, Entry{Prefix: p.Masked(), Action: a, Origin: o})
	}
	if f.NonMasqueradeCIDRsSet {
		for _, p := range f.NonMasqueradeCIDRs {
			add(p, tables.ActionNoMasquerade, tables.OriginConfig)
		}
	} else {
		defaults := DefaultNonMasqueradeCIDRs
		if lim.AllReservedRanges {
			defaults = ReservedNonMasqueradeCIDRs
		}
		for _, p := range defaults {
			add(p, tables.ActionNoMasquerade, tables.OriginDefault)
		}
	}
	if !f.MasqLinkLocal {
		add(linkLocalV4, tables.ActionNoMasquerade, tables.OriginLinkLocal)
	}
	if !f.MasqLinkLocalIPv6 {
		add(linkLocalV6, tables.ActionNoMasquerade, tables.OriginLinkLocal)
	}
	for _, p := range f.MasqueradeCIDRs {
		add(p, tables.ActionMasquerade, tables.OriginConfig)
	}
	slices.SortFunc(out, func(a, b Entry) int {
		if c := compareMasked(a.Prefix, b.Prefix); c != 0 { // masked by add
			return c
		}
		return entryRank(a) - entryRank(b)
	})
	return slices.CompactFunc(out, func(a, b Entry) bool { return a.Prefix == b.Prefix })
}

// familyCounts returns how many IPv4 and IPv6 rows Entries(lim) yields:
// counting the rows themselves keeps one implementation of the defaults,
// link-local and override rules.
func familyCounts(f *File, lim Limits) (v4, v6 int) {
	return countFamilies(f.Entries(lim))
}

func countFamilies(entries []Entry) (v4, v6 int) {
	for _, e := range entries {
		if e.Prefix.Addr().Is4() {
			v4++
		} else {
			v6++
		}
	}
	return v4, v6
}

// checkCapacity checks f's rows, entries (f.Entries(lim), computed once by
// the caller), against the map capacity.
func checkCapacity(path string, f *File, lim Limits, entries []Entry) error {
	if lim.MaxCIDRsPerFamily <= 0 {
		return nil
	}
	v4, v6 := countFamilies(entries)
	what := "nonMasqueradeCIDRs, masqueradeCIDRs and link-local"
	if !f.NonMasqueradeCIDRsSet {
		what = "reserved defaults, masqueradeCIDRs and link-local"
	}
	for _, c := range []struct {
		fam string
		n   int
	}{{"IPv4", v4}, {"IPv6", v6}} {
		if c.n > lim.MaxCIDRsPerFamily {
			return fmt.Errorf("%s: %d %s prefixes (%s) exceed the map capacity of %d (--max-nonmasq-cidrs)",
				path, c.n, c.fam, what, lim.MaxCIDRsPerFamily)
		}
	}
	return nil
}
