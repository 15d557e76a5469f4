package config

import (
	"cmp"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
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

// parseCIDR parses and checks one prefix as written in the file. A prefix
// length with leading zeros (10.0.0.0/08), which the Kubernetes agent's
// net.ParseCIDR takes and netip does not, is read as that agent reads it:
// odd is then what the file says and what is read.
func parseCIDR(s string, lim Limits) (p netip.Prefix, odd string, err error) {
	p, err = netip.ParsePrefix(s)
	if err != nil {
		var ok bool
		if p, ok = netParseCIDR(s); !ok {
			return p, "", notCIDR(s, err)
		}
		odd = fmt.Sprintf("%s is read as %s, as the Kubernetes agent reads it; write %s", quote(s), p, p)
	}
	if m := p.Masked(); m != p {
		return p, "", fmt.Errorf("%s has host bits set; did you mean %s?", s, m)
	}
	if a := p.Addr(); a.Is4In6() {
		// Masked, so Bits() >= 96 (the top 96 bits are ::ffff).
		v4 := netip.PrefixFrom(a.Unmap(), p.Bits()-96)
		return p, "", fmt.Errorf("%s is an IPv4-mapped IPv6 prefix; write it in IPv4 form: %s", s, v4)
	}
	if !familyEnabled(p.Addr(), lim) {
		return p, "", disabledFamily(s, p.Addr())
	}
	return p, odd, nil
}

// netParseCIDR reads s as net.ParseCIDR does where netip is stricter: a
// prefix length with leading zeros. Anything else netip refuses stays
// refused.
func netParseCIDR(s string) (netip.Prefix, bool) {
	addr, bits, ok := strings.Cut(s, "/")
	if !ok || len(bits) < 2 || bits[0] != '0' {
		return netip.Prefix{}, false
	}
	ip, ipnet, err := net.ParseCIDR(s)
	if err != nil {
		return netip.Prefix{}, false
	}
	a, err := netip.ParseAddr(addr)
	if err != nil {
		return netip.Prefix{}, false
	}
	ones, _ := ipnet.Mask.Size()
	if a.Is4() != (ip.To4() != nil) {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, ones), true
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
// deduplicated and sorted, and a warning for each prefix read otherwise
// than written.
func parseCIDRList(path, key string, list []string, lim Limits) ([]netip.Prefix, []tables.ConfigWarning, error) {
	if list == nil {
		return nil, nil, nil
	}
	var warnings []tables.ConfigWarning
	out := make([]netip.Prefix, len(list))
	for i, s := range list {
		p, odd, err := parseCIDR(s, lim)
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %s[%d]: %w", path, key, i, err)
		}
		if odd != "" {
			warnings = append(warnings, oddWarning("%s: %s[%d]: %s", path, key, i, odd))
		}
		out[i] = p
	}
	return sortCompact(out), warnings, nil
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
	var odd []tables.ConfigWarning
	if nonMasqSet {
		if f.NonMasqueradeCIDRs, odd, err = parseCIDRList(path, keyNonMasq, nonMasqRaw, lim); err != nil {
			return nil, nil, nil, err
		}
		warnings = append(warnings, odd...)
		if f.NonMasqueradeCIDRs == nil {
			f.NonMasqueradeCIDRs = []netip.Prefix{}
		}
	}
	if f.MasqueradeCIDRs, odd, err = parseCIDRList(path, keyMasq, raw.MasqueradeCIDRs, lim); err != nil {
		return nil, nil, nil, err
	}
	warnings = append(warnings, odd...)
	if len(f.NonMasqueradeCIDRs) > 0 {
		for j, s := range raw.MasqueradeCIDRs {
			p, _, _ := parseCIDR(s, lim) // validated above
			if !contains(f.NonMasqueradeCIDRs, p) {
				continue
			}
			i := slices.IndexFunc(nonMasqRaw, func(s string) bool { return samePrefix(s, p) })
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

// samePrefix reports whether s, as parseCIDR reads it, is p.
func samePrefix(s string, p netip.Prefix) bool {
	q, _, err := parseCIDR(s, Limits{EnableIPv4: true, EnableIPv6: true})
	return err == nil && q == p
}
