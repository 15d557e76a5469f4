package devices

import (
	"fmt"
	"strings"
	"unicode"
)

// maxNameLen is the longest interface name Linux accepts (IFNAMSIZ - 1).
const maxNameLen = 15

// selector decides which devices masquerade. A nil selector means "the
// devices that carry a default route".
type selector struct {
	patterns []string
	names    map[string]struct{}
	prefixes []string
}

// parseSelector checks the --devices patterns; none gives the nil
// (default-route) selector.
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

// matches reports whether the device name is listed or starts with a listed
// prefix.
func (s *selector) matches(name string) bool {
	if _, ok := s.names[name]; ok {
		return true
	}
	for _, p := range s.prefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

func (s *selector) String() string {
	if s == nil {
		return "devices with a default route"
	}
	return "--devices=" + strings.Join(s.patterns, ",")
}
