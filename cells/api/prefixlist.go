package api

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
// the punctuation, and reports false for anything else.
func parsePlainPrefixes(b []byte) ([]netip.Prefix, bool) {
	b = bytes.TrimSpace(b)
	if string(b) == "null" {
		return nil, true
	}
	if len(b) < 2 || b[0] != '[' || b[len(b)-1] != ']' {
		return nil, false
	}
	b = bytes.TrimSpace(b[1 : len(b)-1])
	out := make([]netip.Prefix, 0, bytes.Count(b, []byte{','})+1)
	for len(b) > 0 {
		if b[0] != '"' {
			return nil, false
		}
		end := bytes.IndexByte(b[1:], '"')
		if end < 0 {
			return nil, false
		}
		s := b[1 : 1+end]
		if bytes.IndexByte(s, '\\') >= 0 {
			return nil, false
		}
		p, err := netip.ParsePrefix(string(s))
		if err != nil {
			return nil, false
		}
		out = append(out, p)
		b = bytes.TrimSpace(b[2+end:])
		if len(b) == 0 {
			break
		}
		if b[0] != ',' {
			return nil, false
		}
		b = bytes.TrimSpace(b[1:])
		if len(b) == 0 {
			return nil, false // trailing comma
		}
	}
	return out, true
}
