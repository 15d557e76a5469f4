package ipamapi

import (
	"bytes"
	"encoding/json"
)

// listKey is how the agent writes the CIDR list's key: after the fields
// that precede it, never first.
const listKey = `,"nonMasqueradeCIDRs":[`

// decodeAllocation decodes an allocation answer as
// json.NewDecoder(bytes.NewReader(b)).Decode would decode it into an
// AllocationResponse, without running encoding/json's scanner over the
// CIDR list: with 16 384 prefixes the list is ~280 KB, and encoding/json
// scanned it twice (reading the value, then skipping it for the list's
// own decoder) before the list was parsed: most of an allocation's time.
//
// The agent writes {<fields>,"nonMasqueradeCIDRs":[<prefixes>]<,"pool":...>}.
// The fields before and after the list are decoded by encoding/json as
// objects of their own, in order, into the same value, and the list by
// parsePlainPrefixes, which accepts only the plain form. The split is
// exact: outside a JSON string the byte pair `,"` separates members, and
// inside one a `"` is always escaped, so the key found is a member key;
// if it belongs to a nested value, the part before it is no complete
// object and the split fails. Anything the split does not recognise goes
// through encoding/json as a whole, so results and errors stay the same.
func decodeAllocation(b []byte, out *allocationWire) error {
	if ok := decodeAllocationSplit(b, out); ok {
		return nil
	}
	*out = allocationWire{}
	return json.NewDecoder(bytes.NewReader(b)).Decode(out)
}

// decodeAllocationSplit is the fast path of decodeAllocation; false means
// it did not apply (out may be partly set).
func decodeAllocationSplit(b []byte, out *allocationWire) bool {
	start := bytes.Index(b, []byte(listKey))
	if start < 0 {
		return false
	}
	fields := bytes.Trim(b[:start], jsonSpace)
	// "{" alone: the answer would start with "{," (not JSON).
	if len(fields) < 2 || fields[0] != '{' {
		return false
	}
	list := b[start+len(listKey)-1:]
	end := bytes.IndexByte(list, ']')
	if end < 0 {
		return false
	}
	rest := bytes.Trim(list[end+1:], jsonSpace)
	list = list[:end+1]
	// What follows the list: the end of the object, or more members.
	var after []byte
	switch {
	case len(rest) == 1 && rest[0] == '}':
	case len(rest) > 1 && rest[0] == ',':
		members := bytes.TrimLeft(rest[1:], jsonSpace)
		if len(members) == 0 || members[0] == '}' {
			return false // "[...],}" is not JSON, "{}" would be
		}
		after = append([]byte{'{'}, members...)
	default:
		// Also data after the object: the Decoder ignores it, json.Unmarshal
		// would not; leave that to the whole decode.
		return false
	}
	// Keys are decoded in the order they appear, into the same value:
	// duplicate keys resolve as in one decode (the last wins).
	if json.Unmarshal(append(fields[:len(fields):len(fields)], '}'), out) != nil {
		return false
	}
	prefixes, ok := parsePlainPrefixes(list)
	if !ok {
		return false
	}
	out.NonMasqueradeCIDRs = prefixes
	if after != nil && json.Unmarshal(after, out) != nil {
		return false
	}
	return true
}
