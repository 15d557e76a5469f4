package config

import (
	"fmt"
)

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
