package config

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

func familyName(p netip.Addr) string {
	if p.Is4() {
		return "IPv4"
	}
	return "IPv6"
}

func familyEnabled(a netip.Addr, lim Limits) bool {
	if a.Is4() {
		return lim.EnableIPv4
	}
	return lim.EnableIPv6
}

func disabledFamily(s string, a netip.Addr) error {
	if a.Is4() {
		return fmt.Errorf("%s is IPv4 but IPv4 is disabled (--enable-ipv4=false)", s)
	}
	return fmt.Errorf("%s is IPv6 but IPv6 is disabled (--enable-ipv6=false)", s)
}

// parseCIDR parses and checks one prefix as written in the file.
func parseCIDR(s string, lim Limits) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return p, notCIDR(s, err)
	}
	if m := p.Masked(); m != p {
		return p, fmt.Errorf("%s has host bits set; did you mean %s?", s, m)
	}
	if a := p.Addr(); a.Is4In6() {
		// Masked, so Bits() >= 96 (the top 96 bits are ::ffff).
		v4 := netip.PrefixFrom(a.Unmap(), p.Bits()-96)
		return p, fmt.Errorf("%s is an IPv4-mapped IPv6 prefix; write it in IPv4 form: %s", s, v4)
	}
	if !familyEnabled(p.Addr(), lim) {
		return p, disabledFamily(s, p.Addr())
	}
	return p, nil
}

// compareMasked orders masked prefixes as netip.Prefix.Compare does
// (family, address, length) without masking them again on every call,
// which was a tenth of parsing 16 384 prefixes.
func compareMasked(a, b netip.Prefix) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return cmp.Compare(a.Bits(), b.Bits())
}

// parseCIDRList validates one list key and returns its prefixes
// deduplicated and sorted.
func parseCIDRList(path, key string, list []string, lim Limits) ([]netip.Prefix, error) {
	if list == nil {
		return nil, nil
	}
	out := make([]netip.Prefix, len(list))
	for i, s := range list {
		p, err := parseCIDR(s, lim)
		if err != nil {
			return nil, fmt.Errorf("%s: %s[%d]: %w", path, key, i, err)
		}
		out[i] = p
	}
	return sortCompact(out), nil
}

func sortCompact(ps []netip.Prefix) []netip.Prefix {
	if !slices.IsSortedFunc(ps, compareMasked) {
		slices.SortFunc(ps, compareMasked)
	}
	return slices.Clip(slices.Compact(ps))
}

func contains(sorted []netip.Prefix, p netip.Prefix) bool {
	_, ok := slices.BinarySearchFunc(sorted, p, compareMasked)
	return ok
}

// MinResyncInterval is the shortest refresh interval: a file's shorter
// resyncInterval is raised to it, with a warning.
const MinResyncInterval = time.Second

// validate checks raw and returns the File, its Entries(lim) and warnings
// about values taken otherwise than written.
func validate(path string, raw *rawFile, nonMasqSet bool, nonMasqRaw []string, lim Limits) (*File, []Entry, []tables.ConfigWarning, error) {
	f := &File{
		NonMasqueradeCIDRsSet: nonMasqSet,
		MasqLinkLocal:         raw.MasqLinkLocal != nil && *raw.MasqLinkLocal,
		MasqLinkLocalIPv6:     raw.MasqLinkLocalIPv6 != nil && *raw.MasqLinkLocalIPv6,
	}
	var warnings []tables.ConfigWarning

	if raw.ResyncInterval != nil {
		s := *raw.ResyncInterval
		d, err := time.ParseDuration(s)
		switch {
		case err != nil:
			return nil, nil, nil, fmt.Errorf("%s: resyncInterval: %s is not a duration (want e.g. 60s or 1m30s)", path, quote(s))
		case d <= 0:
			// The Kubernetes agent takes it and re-syncs without pause.
			warnings = append(warnings, oddWarning("%s: resyncInterval: %s is not above 0; the Kubernetes agent then re-reads the file without pause, ipmasq re-reads it every --resync-interval (%s unless set; and at once on every change)",
				path, quote(s), DefaultResyncInterval))
		case d < MinResyncInterval:
			warnings = append(warnings, oddWarning("%s: resyncInterval: %s is below %s; ipmasq re-reads the file every %s (and at once on every change)",
				path, quote(s), MinResyncInterval, MinResyncInterval))
			f.ResyncInterval = MinResyncInterval
		default:
			f.ResyncInterval = d
		}
	}

	if raw.CIDRLimit != nil {
		n := *raw.CIDRLimit
		total := len(nonMasqRaw) + len(raw.MasqueradeCIDRs)
		switch {
		case lim.V2:
			warnings = append(warnings, oddWarning("%s: cidrLimit: ignored, as ip-masq-agent-v2 ignores it", path))
		case n < 0:
			return nil, nil, nil, fmt.Errorf("%s: cidrLimit: %d is below 0, so not even an empty list fits (the Kubernetes agent refuses it too); leave cidrLimit out for no limit", path, n)
		case total > n:
			return nil, nil, nil, fmt.Errorf("%s: nonMasqueradeCIDRs and masqueradeCIDRs list %d CIDRs, which exceeds cidrLimit %d (raise cidrLimit or remove entries)",
				path, total, n)
		case n <= 0:
			warnings = append(warnings, oddWarning("%s: cidrLimit: %d allows no CIDR in nonMasqueradeCIDRs; leave cidrLimit out for no limit", path, n))
			fallthrough
		default:
			f.CIDRLimit = n
		}
	}

	var err error
	if nonMasqSet {
		if f.NonMasqueradeCIDRs, err = parseCIDRList(path, keyNonMasq, nonMasqRaw, lim); err != nil {
			return nil, nil, nil, err
		}
		if f.NonMasqueradeCIDRs == nil {
			f.NonMasqueradeCIDRs = []netip.Prefix{}
		}
	}
	if f.MasqueradeCIDRs, err = parseCIDRList(path, keyMasq, raw.MasqueradeCIDRs, lim); err != nil {
		return nil, nil, nil, err
	}
	if len(f.NonMasqueradeCIDRs) > 0 {
		for j, s := range raw.MasqueradeCIDRs {
			p := netip.MustParsePrefix(s) // validated above
			if !contains(f.NonMasqueradeCIDRs, p) {
				continue
			}
			i := slices.IndexFunc(nonMasqRaw, func(s string) bool {
				q, err := netip.ParsePrefix(s)
				return err == nil && q == p
			})
			return nil, nil, nil, fmt.Errorf("%s: %s is listed in both %s[%d] and %s[%d]; a destination is either masqueraded or not, remove one",
				path, p, keyNonMasq, i, keyMasq, j)
		}
	}

	entries := f.Entries(lim)
	if err := checkCapacity(path, f, lim, entries); err != nil {
		return nil, nil, nil, err
	}

	if f.MasqueradeRules, err = parseRules(path, raw.MasqueradeRules, lim); err != nil {
		return nil, nil, nil, err
	}
	return f, entries, warnings, nil
}
