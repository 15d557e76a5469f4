package config

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ipmasq/ipmasq/tables"
)

func parseRules(path string, raws []rawRule, lim Limits) ([]tables.MasqueradeRule, error) {
	if len(raws) == 0 {
		return nil, nil
	}
	rules := make([]tables.MasqueradeRule, 0, len(raws))
	byName := make(map[string]int, len(raws))
	for i, r := range raws {
		label := fmt.Sprintf("%s: %s[%d]", path, keyRules, i)
		if err := checkRuleName(r.Name); err != nil {
			return nil, fmt.Errorf("%s: %w", label, err)
		}
		label += " (" + strings.Trim(quote(r.Name), `"`) + ")"
		if j, dup := byName[r.Name]; dup {
			return nil, fmt.Errorf("%s: name %s is already used by %s[%d]; rule names must be unique",
				label, quote(r.Name), keyRules, j)
		}
		byName[r.Name] = i
		rule, err := parseRule(r, lim)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", label, err)
		}
		rules = append(rules, rule)
	}
	return rules, nil
}

func checkRuleName(name string) error {
	if name == "" {
		return errors.New("name is required (letters, digits, '.', '_' and '-', at most 63 characters)")
	}
	if len(name) > maxRuleName {
		return fmt.Errorf("name %s is %d characters long; at most %d are allowed", quote(name), len(name), maxRuleName)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("name %s contains %q; only letters, digits, '.', '_' and '-' are allowed", quote(name), string(rune(c)))
		}
	}
	return nil
}

func parseRule(r rawRule, lim Limits) (tables.MasqueradeRule, error) {
	rule := tables.MasqueradeRule{Name: r.Name}
	if len(r.Sources) == 0 {
		return rule, errors.New("sources is required: list at least one source CIDR, e.g. [10.8.0.0/24]")
	}
	srcs := make([]netip.Prefix, len(r.Sources))
	for i, s := range r.Sources {
		p, err := parseCIDR(s, lim)
		if err != nil {
			return rule, fmt.Errorf("sources[%d]: %w", i, err)
		}
		srcs[i] = p
	}

	if len(r.OutInterfaces) == 0 {
		return rule, errors.New("outInterfaces is required: list at least one device name or prefix pattern, e.g. [eth0] or [eth+]")
	}
	ifs := make([]string, 0, len(r.OutInterfaces))
	for i, s := range r.OutInterfaces {
		if err := checkInterface(s); err != nil {
			return rule, fmt.Errorf("outInterfaces[%d]: %w", i, err)
		}
		if !slices.Contains(ifs, s) {
			ifs = append(ifs, s)
		}
	}

	if r.ToAddress != nil {
		s := *r.ToAddress
		a, err := netip.ParseAddr(s)
		switch {
		case err != nil:
			return rule, fmt.Errorf("toAddress: %s is not an IP address (want e.g. 10.0.0.5 or fd00::5)", quote(s))
		case a.Zone() != "":
			return rule, fmt.Errorf("toAddress: %s has a zone; write the address without %%%s", s, a.Zone())
		case a.Is4In6():
			return rule, fmt.Errorf("toAddress: %s is an IPv4-mapped IPv6 address; write it in IPv4 form: %s", s, a.Unmap())
		case a.IsUnspecified():
			return rule, fmt.Errorf("toAddress: %s is the unspecified address; leave toAddress out to use the device's address", s)
		case a.IsMulticast() || a == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
			return rule, fmt.Errorf("toAddress: %s is not a unicast address", s)
		case a.IsLoopback():
			return rule, fmt.Errorf("toAddress: %s is a loopback address, which cannot leave the node", s)
		case !familyEnabled(a, lim):
			return rule, fmt.Errorf("toAddress: %w", disabledFamily(s, a))
		}
		for i, p := range srcs {
			if p.Addr().Is4() != a.Is4() {
				return rule, fmt.Errorf("toAddress %s is %s but source %s is %s; use one rule per family",
					s, familyName(a), r.Sources[i], familyName(p.Addr()))
			}
		}
		rule.ToAddress = a
	}
	rule.Sources = sortCompact(srcs)
	rule.OutInterfaces = ifs
	return rule, nil
}

// checkInterface accepts a Linux device name (as the kernel's
// dev_valid_name does) or a "prefix+" pattern.
func checkInterface(s string) error {
	name, pattern := strings.CutSuffix(s, "+")
	what := "interface name"
	if pattern {
		what = "interface pattern"
	}
	switch {
	case name == "" && pattern:
		return fmt.Errorf("%s: a pattern needs a name prefix before '+', e.g. eth+", quote(s))
	case name == "":
		return errors.New("empty interface name (want a device name such as eth0 or a pattern such as eth+)")
	case len(name) > maxIfNameLen:
		return fmt.Errorf("%s %s is longer than %d bytes, the Linux limit", what, quote(s), maxIfNameLen)
	case name == "." || name == "..":
		return fmt.Errorf("%s is not a valid %s", quote(s), what)
	}
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case c == '+':
			return fmt.Errorf("%s %s: '+' is only allowed at the end, as a prefix pattern (e.g. eth+)", what, quote(s))
		case c == '/' || c == ':':
			return fmt.Errorf("%s %s contains %q, which Linux does not allow in device names", what, quote(s), string(rune(c)))
		case c <= ' ' || c == 0x7f:
			return fmt.Errorf("%s %s contains whitespace or a control character", what, quote(s))
		}
	}
	return nil
}
