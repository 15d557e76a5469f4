package config

import (
	"bytes"
	"net/netip"
	"reflect"
	"strings"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

// Limits are the agent settings that bound what a config file may contain
// and choose the defaults it gets.
type Limits struct {
	// EnableIPv4 and EnableIPv6 say which families the agent handles; a
	// prefix or address of a disabled family is rejected.
	EnableIPv4, EnableIPv6 bool
	// MaxCIDRsPerFamily is the capacity of each nonmasq BPF map: entries per
	// family after the reserved defaults and link-local are added. 0 or less
	// means unbounded.
	MaxCIDRsPerFamily int
	// AllReservedRanges (--nomasq-all-reserved-ranges) makes the defaults of
	// a file without nonMasqueradeCIDRs ReservedNonMasqueradeCIDRs instead
	// of DefaultNonMasqueradeCIDRs, as the Kubernetes agent's flag does.
	AllReservedRanges bool
	// V2 selects Azure ip-masq-agent-v2's reading of a file: a file
	// without nonMasqueradeCIDRs (or with no content) lists none, so the
	// defaults apply only when there is no file at all, and cidrLimit is
	// not a key (v2 ignores it).
	V2 bool
}

// File is the parsed, validated content of an ip-masq-agent config file.
// Prefix lists are deduplicated and sorted (netip.Prefix.Compare order).
type File struct {
	// NonMasqueradeCIDRs are the destinations that are never masqueraded.
	// It is nil when the key is absent (the reserved defaults apply) and
	// non-nil, possibly empty, when the key is present.
	NonMasqueradeCIDRs []netip.Prefix
	// NonMasqueradeCIDRsSet is true when the key is present, even with an
	// empty list or a null value (as for the Kubernetes ip-masq-agent, a
	// null value is an empty list, not the defaults).
	NonMasqueradeCIDRsSet bool
	// MasqueradeCIDRs are destinations that are masqueraded even inside a
	// non-masquerade range (longest prefix wins).
	MasqueradeCIDRs []netip.Prefix
	// MasqLinkLocal, when false, adds 169.254.0.0/16 to the non-masquerade set.
	MasqLinkLocal bool
	// MasqLinkLocalIPv6, when false, adds fe80::/10 to the non-masquerade set.
	MasqLinkLocalIPv6 bool
	// ResyncInterval is the drift-repair interval; 0 when absent.
	ResyncInterval time.Duration
	// CIDRLimit is the Kubernetes agent's cap on the number of listed
	// CIDRs; 0 when absent.
	CIDRLimit int
	// MasqueradeRules masquerade non-pod sources, in file order; Sources
	// are deduplicated and sorted, OutInterfaces deduplicated in file order.
	MasqueradeRules []tables.MasqueradeRule
	// UnknownKeys are the file's top-level keys the format does not know,
	// sorted: ignored, as the Kubernetes agent ignores them (the loader
	// warns about each, with the known key nearest to it).
	UnknownKeys []string
}

// Entry is one desired row of the nonmasq-cidrs table.
type Entry struct {
	Prefix netip.Prefix
	Action tables.Action
	Origin tables.Origin
}

// DefaultNonMasqueradeCIDRs are the RFC 1918 private ranges, used when
// nonMasqueradeCIDRs is absent: the Kubernetes ip-masq-agent's defaults, so
// that everything else (100.64.0.0/10 included) is masqueraded as it is
// there. Callers must not modify it.
var DefaultNonMasqueradeCIDRs = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.168.0.0/16"),
}

// ReservedNonMasqueradeCIDRs are every IPv4 range an RFC reserves, used
// instead of DefaultNonMasqueradeCIDRs with --nomasq-all-reserved-ranges
// (only when nonMasqueradeCIDRs is absent, as in the Kubernetes agent).
// Callers must not modify it.
var ReservedNonMasqueradeCIDRs = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("192.0.0.0/24"),
	netip.MustParsePrefix("192.0.2.0/24"),
	netip.MustParsePrefix("192.88.99.0/24"),
	netip.MustParsePrefix("198.18.0.0/15"),
	netip.MustParsePrefix("198.51.100.0/24"),
	netip.MustParsePrefix("203.0.113.0/24"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

var (
	linkLocalV4 = netip.MustParsePrefix("169.254.0.0/16")
	linkLocalV6 = netip.MustParsePrefix("fe80::/10")
)

const (
	keyNonMasq   = "nonMasqueradeCIDRs"
	keyMasq      = "masqueradeCIDRs"
	keyRules     = "masqueradeRules"
	maxIfNameLen = 15 // IFNAMSIZ - 1
	maxRuleName  = 63
	wantCIDR     = "(want e.g. 10.0.0.0/8 or fd00::/8)"
)

// The format's keys are rawFile's and rawRule's json tags, listed nowhere
// else: a new key is a field below (then its validation and its row), and
// error messages and key suggestions follow.
var (
	topLevelKeys = strings.Join(jsonKeys[rawFile](), ", ")
	ruleKeys     = strings.Join(jsonKeys[rawRule](), ", ")
	// knownKeys are every key of the format, top level and in a rule, for
	// suggesting the closest one to a misspelt key.
	knownKeys = append(jsonKeys[rawFile](), jsonKeys[rawRule]()...)
)

// jsonKeys lists T's json tags in field order.
func jsonKeys[T any]() []string {
	t := reflect.TypeFor[T]()
	keys := make([]string, 0, t.NumField())
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		keys = append(keys, name)
	}
	return keys
}

// rawFile is the file as decoded, before validation.
type rawFile struct {
	NonMasqueradeCIDRs *[]string `json:"nonMasqueradeCIDRs"`
	MasqueradeCIDRs    []string  `json:"masqueradeCIDRs"`
	MasqLinkLocal      *bool     `json:"masqLinkLocal"`
	MasqLinkLocalIPv6  *bool     `json:"masqLinkLocalIPv6"`
	ResyncInterval     *string   `json:"resyncInterval"`
	CIDRLimit          *int      `json:"cidrLimit"`
	MasqueradeRules    []rawRule `json:"masqueradeRules"`
}

type rawRule struct {
	Name          string   `json:"name"`
	Sources       []string `json:"sources"`
	OutInterfaces []string `json:"outInterfaces"`
	ToAddress     *string  `json:"toAddress"`
}

// Parse parses and validates data read from path. An empty (zero-byte or
// whitespace-only) data is the same as an absent file: the returned File
// has no keys set, so Entries gives the defaults. Errors name the file, the
// key (with list index, e.g. nonMasqueradeCIDRs[2]) and the value, and say
// what would be accepted. Parse does no I/O.
func Parse(path string, data []byte, lim Limits) (*File, error) {
	p, err := parse(path, data, lim)
	if err != nil {
		return nil, err
	}
	return p.file, nil
}

// parsed is one file's content as the loader needs it.
type parsed struct {
	file *File
	// entries are file.Entries(lim), which validation computes anyway:
	// computing them twice cost a sort of 16 384 rows per load.
	entries []Entry
	// warnings are what the file says oddly, or keys it has that the
	// format does not know, each naming the file.
	warnings []tables.ConfigWarning
	// linkLocalSet and linkLocalV6Set say whether the file sets
	// masqLinkLocal and masqLinkLocalIPv6 (to either value), which merging
	// several files needs to tell a disagreement from silence.
	linkLocalSet, linkLocalV6Set bool
}

// parse is Parse for the loader.
func parse(path string, data []byte, lim Limits) (*parsed, error) {
	if path == "" {
		path = "<config>"
	}
	data = bytes.TrimPrefix(data, []byte("\xef\xbb\xbf")) // UTF-8 BOM
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) == 0 {
		f := &File{}
		if lim.V2 {
			f.NonMasqueradeCIDRsSet, f.NonMasqueradeCIDRs = true, []netip.Prefix{}
		}
		entries := f.Entries(lim)
		if err := checkCapacity(path, f, lim, entries); err != nil {
			return nil, err
		}
		return &parsed{file: f, entries: entries}, nil
	}

	var raw rawFile
	// A pre-set pointer tells "absent" (pointer untouched, slice nil) from
	// null (decoder sets the pointer to nil) and from a list (slice non-nil).
	absent := new([]string)
	raw.NonMasqueradeCIDRs = absent
	unknown, odd, err := decode(path, trimmed, &raw, absent)
	if err != nil {
		return nil, err
	}
	nonMasqSet := true
	var nonMasqRaw []string
	switch {
	case raw.NonMasqueradeCIDRs == nil: // null: empty list
	case raw.NonMasqueradeCIDRs == absent && *absent == nil:
		nonMasqSet = lim.V2
	default:
		nonMasqRaw = *raw.NonMasqueradeCIDRs
	}
	f, entries, vodd, err := validate(path, &raw, nonMasqSet, nonMasqRaw, lim)
	if err != nil {
		return nil, err
	}
	f.UnknownKeys = unknown
	warnings := append(unknownKeyWarnings(path, f), odd...)
	return &parsed{file: f, entries: entries, warnings: append(warnings, vodd...),
		linkLocalSet: raw.MasqLinkLocal != nil, linkLocalV6Set: raw.MasqLinkLocalIPv6 != nil}, nil
}
