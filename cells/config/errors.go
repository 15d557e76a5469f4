package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strconv"
	"strings"
)

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
		return unknownFieldError{fmt.Errorf("%s: unknown field %s (%sknown keys: %s; in masqueradeRules entries: %s)",
			path, field, hint, topLevelKeys, ruleKeys)}
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

// unknownFieldError is a key the format does not know, found by a strict
// decoding pass.
type unknownFieldError struct{ error }

func (e unknownFieldError) Unwrap() error { return e.error }

// closestKey suggests a known key for a misspelt one.
func closestKey(s string) string { return closestKeyIn(s, knownKeys) }

// closestKeyIn suggests the key of keys nearest to s (edit distance under
// 4, case-insensitively), or "".
func closestKeyIn(s string, keys []string) string {
	best, bestD := "", 4
	for _, k := range keys {
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
