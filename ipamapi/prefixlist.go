package ipamapi

import (
	"bytes"
	"encoding/json"
	"net/netip"
)

// allocationWire is AllocationResponse as the client decodes it: the CIDR
// list, almost all of an answer with a large config, has its own decoder
// (its field shadows the embedded one).
type allocationWire struct {
	AllocationResponse
	NonMasqueradeCIDRs prefixList `json:"nonMasqueradeCIDRs,omitempty"`
}

// prefixList decodes a JSON array of prefixes about ten times faster than
// encoding/json's reflection over []netip.Prefix (16 384 prefixes: ~15 ms),
// for the plain form the agent writes. Anything else (escapes, odd
// spacing, bad values) goes through encoding/json, so the result and the
// errors are the same as decoding []netip.Prefix.
type prefixList []netip.Prefix

// UnmarshalJSON implements json.Unmarshaler.
func (l *prefixList) UnmarshalJSON(b []byte) error {
	if out, ok := parsePlainPrefixes(b); ok {
		*l = out
		return nil
	}
	var out []netip.Prefix
	if err := json.Unmarshal(b, &out); err != nil {
		return err
	}
	*l = out
	return nil
}

// parsePlainPrefixes parses ["p1","p2",...] with optional spaces around
// the punctuation, and reports false for anything else. It is one pass
// over the bytes: IPv4 prefixes in canonical form are parsed in place,
// others by netip.ParsePrefix from a substring of one copy of the list,
// made when the first one is met (a conversion per prefix would allocate
// 16 384 strings for a large config; a Prefix keeps no reference to its
// text).
func parsePlainPrefixes(b []byte) ([]netip.Prefix, bool) {
	b = trimJSONSpace(b)
	if string(b) == "null" {
		return nil, true
	}
	if len(b) < 2 || b[0] != '[' || b[len(b)-1] != ']' {
		return nil, false
	}
	b = b[:len(b)-1]
	var text string // b as a string, once needed
	out := make([]netip.Prefix, 0, bytes.Count(b, []byte{','})+1)
	i := skipJSONSpace(b, 1)
	for i < len(b) {
		if b[i] != '"' {
			return nil, false
		}
		i++
		p, n, ok := parsePlainIPv4Prefix(b[i:])
		if ok && i+n < len(b) && b[i+n] == '"' {
			i += n + 1
		} else {
			end := bytes.IndexByte(b[i:], '"')
			if end < 0 || bytes.IndexByte(b[i:i+end], '\\') >= 0 {
				return nil, false
			}
			if text == "" {
				text = string(b)
			}
			var err error
			if p, err = netip.ParsePrefix(text[i : i+end]); err != nil {
				return nil, false
			}
			i += end + 1
		}
		out = append(out, p)
		i = skipJSONSpace(b, i)
		if i == len(b) {
			break
		}
		if b[i] != ',' {
			return nil, false
		}
		if i = skipJSONSpace(b, i+1); i == len(b) {
			return nil, false // trailing comma
		}
	}
	return out, true
}

// parsePlainIPv4Prefix parses an IPv4 prefix in its canonical form (four
// decimal fields and a length, without leading zeros) at the start of b,
// and returns how many bytes it took; false for anything else, then
// netip.ParsePrefix decides. What it accepts, ParsePrefix parses to the
// same prefix.
//
// It runs 16 384 times per answer with a large config: one loop over the
// five numbers, with no call per number, and digit tests by the unsigned
// wrap-around of c-'0' (one comparison each).
func parsePlainIPv4Prefix(b []byte) (netip.Prefix, int, bool) {
	var a [4]byte
	i := 0
	for f := range 5 {
		if i >= len(b) || b[i]-'0' > 9 {
			return netip.Prefix{}, 0, false
		}
		n := uint(b[i] - '0')
		i++
		if n != 0 { // a leading 0 is the whole number
			for end := i + 2; i < end && i < len(b) && b[i]-'0' <= 9; i++ {
				n = n*10 + uint(b[i]-'0')
			}
		}
		if i < len(b) && b[i]-'0' <= 9 {
			return netip.Prefix{}, 0, false // a leading zero or a fourth digit
		}
		if f == 4 {
			if n > 32 {
				return netip.Prefix{}, 0, false
			}
			return netip.PrefixFrom(netip.AddrFrom4(a), int(n)), i, true
		}
		sep := byte('.')
		if f == 3 {
			sep = '/'
		}
		if n > 255 || i == len(b) || b[i] != sep {
			return netip.Prefix{}, 0, false
		}
		a[f] = byte(n)
		i++
	}
	panic("unreachable")
}

// jsonSpace is the whitespace JSON allows around values; bytes.TrimSpace
// would also cut other Unicode spaces, accepting text that is not JSON.
const jsonSpace = " \t\r\n"

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }

// skipJSONSpace returns the index of the first byte at or after i that is
// not JSON whitespace.
func skipJSONSpace(b []byte, i int) int {
	for i < len(b) && isJSONSpace(b[i]) {
		i++
	}
	return i
}

// trimJSONSpace cuts JSON whitespace at both ends (bytes.Trim with a
// cutset costs more than parsing a prefix).
func trimJSONSpace(b []byte) []byte {
	b = b[skipJSONSpace(b, 0):]
	for len(b) > 0 && isJSONSpace(b[len(b)-1]) {
		b = b[:len(b)-1]
	}
	return b
}
