package devices

import (
	"fmt"
	"strings"
	"unicode"
)

// maxNameLen is the longest interface name Linux accepts (IFNAMSIZ - 1).
const maxNameLen = 15

// selector decides which devices masquerade. A nil selector means "the
// devices a forwarded packet can leave through" (see routeCoverage).
type selector struct {
	patterns []string
	names    map[string]struct{}
	prefixes []string
}

// parseSelector checks the --devices patterns; none gives the nil
// (every uplink) selector.
func parseSelector(patterns []string) (*selector, error) {
	if len(patterns) == 0 {
		return nil, nil
	}
	s := &selector{patterns: patterns, names: make(map[string]struct{})}
	for _, p := range patterns {
		name, isPrefix := strings.CutSuffix(p, "+")
		if err := checkName(name, isPrefix); err != nil {
			return nil, fmt.Errorf("--devices=%q: %w; give interface names (eth0) or name prefixes ending in + (eth+)", p, err)
		}
		if isPrefix {
			s.prefixes = append(s.prefixes, name)
		} else {
			s.names[name] = struct{}{}
		}
	}
	return s, nil
}

// checkName applies the kernel's rules for interface names (dev_valid_name)
// to a name or the prefix of a pattern.
func checkName(name string, isPrefix bool) error {
	switch {
	case name == "" && isPrefix:
		return fmt.Errorf("a bare + would select every device")
	case name == "":
		return fmt.Errorf("empty device name")
	case len(name) > maxNameLen:
		return fmt.Errorf("longer than %d characters, the longest interface name Linux allows", maxNameLen)
	case !isPrefix && (name == "." || name == ".."):
		return fmt.Errorf("not a valid interface name")
	}
	for _, r := range name {
		switch {
		case r == '/' || r == ':':
			return fmt.Errorf("interface names cannot contain %q", r)
		case r == '+':
			return fmt.Errorf("+ is only allowed at the end, as a prefix pattern")
		case unicode.IsSpace(r) || !unicode.IsPrint(r):
			return fmt.Errorf("interface names cannot contain spaces or control characters")
		}
	}
	return nil
}

// match returns the pattern that selects the device name (the name
// itself, or a "prefix+" pattern), "" for none.
func (s *selector) match(name string) string {
	if _, ok := s.names[name]; ok {
		return name
	}
	for _, p := range s.prefixes {
		if strings.HasPrefix(name, p) {
			return p + "+"
		}
	}
	return ""
}

func (s *selector) String() string {
	if s == nil {
		return "devices with a route the node forwards through"
	}
	return "--devices=" + strings.Join(s.patterns, ",")
}
