package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/ipmasq/ipmasq/tables"
)

// Limits are the agent settings that bound what a config file may contain.
type Limits struct {
	// EnableIPv4 and EnableIPv6 say which families the agent handles; a
	// prefix or address of a disabled family is rejected.
	EnableIPv4, EnableIPv6 bool
	// MaxCIDRsPerFamily is the capacity of each nonmasq BPF map: entries per
	// family after the reserved defaults and link-local are added. 0 or less
	// means unbounded.
	MaxCIDRsPerFamily int
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
	// MasqueradeRules masquerade non-pod sources, in file order.
	MasqueradeRules []MasqueradeRule
}

// MasqueradeRule masquerades traffic from Sources leaving through OutInterfaces.
type MasqueradeRule struct {
	// Name identifies the rule; unique within a file.
	Name string
	// Sources are the source prefixes the rule applies to, deduplicated
	// and sorted.
	Sources []netip.Prefix
	// OutInterfaces are exact device names or "prefix+" patterns, in file
	// order with duplicates removed.
	OutInterfaces []string
	// ToAddress is the SNAT address; the zero Addr when absent (the egress
	// device's primary address is used).
	ToAddress netip.Addr
}

// Entry is one desired row of the nonmasq-cidrs table.
type Entry struct {
	Prefix netip.Prefix
	Action tables.Action
	Origin tables.Origin
}

// DefaultNonMasqueradeCIDRs are the reserved ranges used when
// nonMasqueradeCIDRs is absent. Callers must not modify it.
var DefaultNonMasqueradeCIDRs = []netip.Prefix{
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
	topLevelKeys = "nonMasqueradeCIDRs, masqueradeCIDRs, masqLinkLocal, masqLinkLocalIPv6, resyncInterval, cidrLimit, masqueradeRules"
	ruleKeys     = "name, sources, outInterfaces, toAddress"
)

// rawFile is the file as decoded, before validation.
type rawFile struct {
	NonMasqueradeCIDRs *[]string `json:"nonMasqueradeCIDRs"`
	MasqueradeCIDRs    []string  `json:"masqueradeCIDRs"`
	MasqLinkLocal      bool      `json:"masqLinkLocal"`
	MasqLinkLocalIPv6  bool      `json:"masqLinkLocalIPv6"`
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
	if path == "" {
		path = "<config>"
	}
	data = bytes.TrimPrefix(data, []byte("\xef\xbb\xbf")) // UTF-8 BOM
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) == 0 {
		f := &File{}
		if err := checkCapacity(path, f, lim); err != nil {
			return nil, err
		}
		return f, nil
	}

	var raw rawFile
	// A pre-set pointer tells "absent" (pointer untouched, slice nil) from
	// null (decoder sets the pointer to nil) and from a list (slice non-nil).
	absent := new([]string)
	raw.NonMasqueradeCIDRs = absent
	if err := decode(path, trimmed, &raw, absent); err != nil {
		return nil, err
	}
	nonMasqSet := true
	var nonMasqRaw []string
	switch {
	case raw.NonMasqueradeCIDRs == nil: // null: empty list
	case raw.NonMasqueradeCIDRs == absent && *absent == nil:
		nonMasqSet = false
	default:
		nonMasqRaw = *raw.NonMasqueradeCIDRs
	}
	return validate(path, &raw, nonMasqSet, nonMasqRaw, lim)
}

// yamlSyntaxError is a YAML document that could not be read at all.
type yamlSyntaxError struct{ error }

// decode fills raw from JSON (when data starts with '{') or YAML. absent is
// the sentinel Parse put in raw.NonMasqueradeCIDRs.
func decode(path string, data []byte, raw *rawFile, absent *[]string) error {
	if data[0] == '{' {
		err := decodeJSON(path, data, raw)
		var se *json.SyntaxError
		if !errors.As(err, &se) {
			return err
		}
		// Not JSON; it may be a YAML flow mapping such as
		// {nonMasqueradeCIDRs: [10.0.0.0/8]}.
		*raw = rawFile{NonMasqueradeCIDRs: absent}
		*absent = nil
		yerr := decodeYAML(path, data, raw)
		if ys := (yamlSyntaxError{}); errors.As(yerr, &ys) {
			// Neither; the author most likely meant JSON.
			line, col := lineCol(data, se.Offset-1) // Offset is just past the bad byte
			return fmt.Errorf("%s: invalid JSON at line %d, column %d: %s", path, line, col,
				strings.TrimPrefix(se.Error(), "json: "))
		}
		return yerr
	}
	return decodeYAML(path, data, raw)
}

func decodeJSON(path string, data []byte, raw *rawFile) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(raw); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return err // the caller tries YAML, then reports it
		}
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return fmt.Errorf("%s: invalid JSON: the file ends before the top-level object is closed (truncated?)", path)
		}
		return decodeError(path, err, data, true)
	}
	if off := dec.InputOffset(); len(bytes.TrimSpace(data[off:])) != 0 {
		line, col := lineCol(data, off+int64(len(data[off:])-len(bytes.TrimLeft(data[off:], " \t\r\n"))))
		return fmt.Errorf("%s: invalid JSON at line %d, column %d: unexpected data after the top-level object", path, line, col)
	}
	if key, ok := jsonDuplicateKey(data); ok {
		return fmt.Errorf("%s: key %s is set more than once in the same object; keep one", path, quote(key))
	}
	return nil
}

// knownKeys are every key of the format, top level and in a rule.
var knownKeys = []string{"nonMasqueradeCIDRs", "masqueradeCIDRs", "masqLinkLocal",
	"masqLinkLocalIPv6", "resyncInterval", "cidrLimit", "masqueradeRules",
	"name", "sources", "outInterfaces", "toAddress"}

func decodeYAML(path string, data []byte, raw *rawFile) error {
	if line := secondYAMLDocument(data); line > 0 {
		return fmt.Errorf("%s: line %d: a second YAML document starts here; put all keys in one document", path, line)
	}
	err := yaml.UnmarshalStrict(data, raw)
	if err == nil {
		return nil
	}
	msg := err.Error()
	if rest, ok := strings.CutPrefix(msg, "error converting YAML to JSON: "); ok {
		rest = strings.TrimPrefix(rest, "yaml: ")
		rest = strings.TrimPrefix(rest, "unmarshal errors:")
		return yamlSyntaxError{fmt.Errorf("%s: invalid YAML: %s", path, oneLine(rest))}
	}
	return decodeError(path, err, data, false)
}

// decodeError turns an encoding/json decoding error into an operator message.
func decodeError(path string, err error, data []byte, isJSON bool) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		where := ""
		if isJSON {
			line, col := lineCol(data, te.Offset-1) // Offset is just past the value
			where = fmt.Sprintf(" (near line %d, column %d)", line, col)
		}
		if te.Field == "" {
			return fmt.Errorf("%s: the file must be a mapping with keys such as %s, got %s%s",
				path, topLevelKeys, describeJSONValue(te.Value), where)
		}
		return fmt.Errorf("%s: %s: got %s, want %s%s", path, te.Field,
			describeJSONValue(te.Value), describeType(te.Field, te.Type), where)
	}
	msg := err.Error()
	if i := strings.Index(msg, `json: unknown field "`); i >= 0 {
		field := msg[i+len(`json: unknown field `):]
		name, uerr := strconv.Unquote(field)
		hint := ""
		if uerr == nil {
			if s := closestKey(name); s != "" {
				hint = fmt.Sprintf("did you mean %s? ", s)
			}
		}
		return fmt.Errorf("%s: unknown field %s (%sknown keys: %s; in masqueradeRules entries: %s)",
			path, field, hint, topLevelKeys, ruleKeys)
	}
	msg = strings.TrimPrefix(msg, "error unmarshaling JSON: ")
	msg = strings.TrimPrefix(msg, "while decoding JSON: ")
	msg = strings.TrimPrefix(msg, "json: ")
	return fmt.Errorf("%s: %s", path, oneLine(msg))
}

func describeJSONValue(v string) string {
	switch {
	case v == "array":
		return "a list"
	case v == "object":
		return "a mapping"
	case v == "bool":
		return "a boolean"
	case v == "string":
		return "a string"
	case v == "number":
		return "a number"
	}
	return v // "number 1.5" etc.
}

func describeType(field string, t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		switch {
		case field == "resyncInterval":
			return "a duration string such as 60s"
		case strings.HasSuffix(field, "CIDRs"), strings.HasSuffix(field, "sources"):
			return "a CIDR string such as 10.0.0.0/8"
		case strings.HasSuffix(field, "toAddress"):
			return "an IP address string such as 10.0.0.5"
		}
		return "a string"
	case reflect.Int:
		return "a whole number greater than 0"
	case reflect.Slice:
		return "a list"
	case reflect.Struct:
		if strings.HasSuffix(field, keyRules) {
			return "a mapping with keys " + ruleKeys
		}
		return "a mapping"
	}
	return t.String()
}

// closestKey suggests a known key for a misspelt one.
func closestKey(s string) string {
	best, bestD := "", 4
	for _, k := range knownKeys {
		if d := editDistance(strings.ToLower(s), strings.ToLower(k)); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return 1 << 30
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			c := prev[j-1]
			if a[i-1] != b[j-1] {
				c++
			}
			cur[j] = min(c, prev[j]+1, cur[j-1]+1)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func oneLine(s string) string {
	f := strings.Fields(s)
	return strings.Join(f, " ")
}

func lineCol(data []byte, off int64) (line, col int) {
	if off < 0 {
		off = 0
	}
	if off > int64(len(data)) {
		off = int64(len(data))
	}
	before := data[:off]
	line = bytes.Count(before, []byte{'\n'}) + 1
	col = int(off) - (bytes.LastIndexByte(before, '\n') + 1) + 1
	return line, col
}

// secondYAMLDocument returns the 1-based line of a "---" document marker
// that follows content, or 0. yaml.Unmarshal silently reads only the first
// document, which would drop the rest of an operator's file.
func secondYAMLDocument(data []byte) int {
	seen := false
	line := 0
	for len(data) > 0 {
		line++
		var l []byte
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			l, data = data[:i], data[i+1:]
		} else {
			l, data = data, nil
		}
		if bytes.HasPrefix(l, []byte("---")) && (len(l) == 3 || l[3] == ' ' || l[3] == '\t' || l[3] == '\r') {
			if seen {
				return line
			}
			l = l[3:]
		}
		if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' {
			seen = true
		}
	}
	return 0
}

// jsonDuplicateKey reports the first key that appears twice in one object of
// data, which must be valid JSON. encoding/json would silently keep the
// last; YAML's strict mode rejects them, and so do we.
func jsonDuplicateKey(data []byte) (string, bool) {
	type frame struct {
		object bool
		keys   []string
	}
	var stack []frame
	for i := 0; i < len(data); i++ {
		switch data[i] {
		case '{':
			stack = append(stack, frame{object: true})
		case '[':
			stack = append(stack, frame{})
		case '}', ']':
			if len(stack) > 0 {
				stack = stack[:len(stack)-1]
			}
		case '"':
			start := i
			escaped := false
			for i++; i < len(data); i++ {
				if data[i] == '\\' {
					escaped = true
					i++
					continue
				}
				if data[i] == '"' {
					break
				}
			}
			if len(stack) == 0 || !stack[len(stack)-1].object || i >= len(data) {
				continue
			}
			j := i + 1
			for j < len(data) && (data[j] == ' ' || data[j] == '\t' || data[j] == '\r' || data[j] == '\n') {
				j++
			}
			if j >= len(data) || data[j] != ':' {
				continue // a value, not a key
			}
			key := string(data[start+1 : i])
			if escaped {
				if err := json.Unmarshal(data[start:i+1], &key); err != nil {
					continue
				}
			}
			top := &stack[len(stack)-1]
			if slices.Contains(top.keys, key) {
				return key, true
			}
			top.keys = append(top.keys, key)
		}
	}
	return "", false
}

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

func notCIDR(s string, err error) error {
	base := fmt.Sprintf("%s is not a CIDR %s", quote(s), wantCIDR)
	if t := strings.TrimSpace(s); t != s {
		if _, err := netip.ParsePrefix(t); err == nil {
			return fmt.Errorf("%s; remove the surrounding whitespace", base)
		}
	}
	if strings.Contains(s, "%") {
		return fmt.Errorf("%s; IPv6 zones (%%name) are not allowed in a CIDR", base)
	}
	if a, err := netip.ParseAddr(s); err == nil {
		return fmt.Errorf("%s; for a single address write %s", base, netip.PrefixFrom(a, a.BitLen()))
	}
	if strings.HasSuffix(err.Error(), "prefix length out of range") {
		if i := strings.LastIndexByte(s, '/'); i >= 0 {
			if a, err := netip.ParseAddr(s[:i]); err == nil {
				return fmt.Errorf("%s; the prefix length must be 0-%d for %s", base, a.BitLen(), familyName(a))
			}
		}
	}
	return errors.New(base)
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
	if !slices.IsSortedFunc(ps, netip.Prefix.Compare) {
		slices.SortFunc(ps, netip.Prefix.Compare)
	}
	return slices.Clip(slices.Compact(ps))
}

func contains(sorted []netip.Prefix, p netip.Prefix) bool {
	_, ok := slices.BinarySearchFunc(sorted, p, netip.Prefix.Compare)
	return ok
}

func validate(path string, raw *rawFile, nonMasqSet bool, nonMasqRaw []string, lim Limits) (*File, error) {
	f := &File{
		NonMasqueradeCIDRsSet: nonMasqSet,
		MasqLinkLocal:         raw.MasqLinkLocal,
		MasqLinkLocalIPv6:     raw.MasqLinkLocalIPv6,
	}

	if raw.ResyncInterval != nil {
		s := *raw.ResyncInterval
		d, err := time.ParseDuration(s)
		switch {
		case err != nil:
			return nil, fmt.Errorf("%s: resyncInterval: %s is not a duration (want e.g. 60s or 1m30s)", path, quote(s))
		case d <= 0:
			return nil, fmt.Errorf("%s: resyncInterval: %s must be greater than 0 (want e.g. 60s)", path, quote(s))
		}
		f.ResyncInterval = d
	}

	if raw.CIDRLimit != nil {
		n := *raw.CIDRLimit
		if n <= 0 {
			return nil, fmt.Errorf("%s: cidrLimit: %d must be greater than 0 (or leave cidrLimit out for no limit)", path, n)
		}
		f.CIDRLimit = n
		if total := len(nonMasqRaw) + len(raw.MasqueradeCIDRs); total > n {
			return nil, fmt.Errorf("%s: nonMasqueradeCIDRs and masqueradeCIDRs list %d CIDRs, which exceeds cidrLimit %d (raise cidrLimit or remove entries)",
				path, total, n)
		}
	}

	var err error
	if nonMasqSet {
		if f.NonMasqueradeCIDRs, err = parseCIDRList(path, keyNonMasq, nonMasqRaw, lim); err != nil {
			return nil, err
		}
		if f.NonMasqueradeCIDRs == nil {
			f.NonMasqueradeCIDRs = []netip.Prefix{}
		}
	}
	if f.MasqueradeCIDRs, err = parseCIDRList(path, keyMasq, raw.MasqueradeCIDRs, lim); err != nil {
		return nil, err
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
			return nil, fmt.Errorf("%s: %s is listed in both %s[%d] and %s[%d]; a destination is either masqueraded or not, remove one",
				path, p, keyNonMasq, i, keyMasq, j)
		}
	}

	if err := checkCapacity(path, f, lim); err != nil {
		return nil, err
	}

	if f.MasqueradeRules, err = parseRules(path, raw.MasqueradeRules, lim); err != nil {
		return nil, err
	}
	return f, nil
}

// familyCounts returns how many IPv4 and IPv6 rows Entries(lim) yields,
// without building them. It relies on the lists being sorted and
// deduplicated, and on nonMasqueradeCIDRs and masqueradeCIDRs being
// disjoint, as Parse guarantees.
func familyCounts(f *File, lim Limits) (v4, v6 int) {
	count := func(p netip.Prefix) {
		if !familyEnabled(p.Addr(), lim) {
			return
		}
		if p.Addr().Is4() {
			v4++
		} else {
			v6++
		}
	}
	for _, p := range f.NonMasqueradeCIDRs {
		count(p)
	}
	for _, p := range f.MasqueradeCIDRs {
		count(p)
	}
	listed := func(p netip.Prefix) bool {
		return contains(f.NonMasqueradeCIDRs, p) || contains(f.MasqueradeCIDRs, p)
	}
	if !f.NonMasqueradeCIDRsSet {
		for _, p := range DefaultNonMasqueradeCIDRs {
			if !contains(f.MasqueradeCIDRs, p) {
				count(p)
			}
		}
	}
	if !f.MasqLinkLocal && !listed(linkLocalV4) {
		count(linkLocalV4)
	}
	if !f.MasqLinkLocalIPv6 && !listed(linkLocalV6) {
		count(linkLocalV6)
	}
	return v4, v6
}

func checkCapacity(path string, f *File, lim Limits) error {
	if lim.MaxCIDRsPerFamily <= 0 {
		return nil
	}
	v4, v6 := familyCounts(f, lim)
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

func parseRules(path string, raws []rawRule, lim Limits) ([]MasqueradeRule, error) {
	if len(raws) == 0 {
		return nil, nil
	}
	rules := make([]MasqueradeRule, 0, len(raws))
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

func parseRule(r rawRule, lim Limits) (MasqueradeRule, error) {
	rule := MasqueradeRule{Name: r.Name}
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
// file: defaults). It applies the reserved defaults (OriginDefault) when
// NonMasqueradeCIDRsSet is false; adds 169.254.0.0/16 unless MasqLinkLocal
// and fe80::/10 unless MasqLinkLocalIPv6 (OriginLinkLocal; a prefix the
// user listed explicitly keeps OriginConfig); and adds masqueradeCIDRs as
// ActionMasquerade/OriginConfig, which override a default or link-local
// row for the same prefix. Only the families enabled in lim are included.
// The result is sorted by prefix (netip.Prefix.Compare) with no duplicates.
func (f *File) Entries(lim Limits) []Entry {
	if f == nil {
		f = &File{}
	}
	out := make([]Entry, 0, len(f.NonMasqueradeCIDRs)+len(f.MasqueradeCIDRs)+len(DefaultNonMasqueradeCIDRs)+2)
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
		for _, p := range DefaultNonMasqueradeCIDRs {
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
		if c := a.Prefix.Compare(b.Prefix); c != 0 {
			return c
		}
		return entryRank(a) - entryRank(b)
	})
	return slices.CompactFunc(out, func(a, b Entry) bool { return a.Prefix == b.Prefix })
}

// quote quotes a value from the file for an error message, shortening long
// ones so one bad value cannot make a huge log line, health message or
// status row.
func quote(v string) string {
	const max = 64
	if len(v) <= max {
		return strconv.Quote(v)
	}
	return fmt.Sprintf("%s… (%d bytes)", strconv.Quote(v[:max]), len(v))
}
