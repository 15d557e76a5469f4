package config

// fastDecodeJSON decodes the common shape of a JSON config (a top-level
// object of the scalar keys and plain string lists) without reflection:
// with 16 384 prefixes, encoding/json took most of the parse.
// It returns false, leaving raw as it found it, for anything it is not
// sure to decode exactly as decodeJSON would (masqueradeRules, escapes,
// non-ASCII, null scalars, numbers other than plain integers, unknown or
// repeated keys, bad syntax); decodeJSON then decodes the file or names
// the error. data must be trimmed of surrounding white space.
func fastDecodeJSON(data []byte, raw *rawFile) bool {
	d := fastJSON{data: data}
	var out rawFile
	out.NonMasqueradeCIDRs = raw.NonMasqueradeCIDRs
	var list []string // nonMasqueradeCIDRs when present as a list
	listSet := false
	if !d.byte('{') {
		return false
	}
	seen := map[string]bool{}
	for first := true; ; first = false {
		d.space()
		if d.peek() == '}' && first {
			d.pos++
			break
		}
		key, ok := d.str()
		if !ok || seen[key] {
			return false
		}
		seen[key] = true
		d.space()
		if !d.byte(':') {
			return false
		}
		d.space()
		switch key {
		case "nonMasqueradeCIDRs":
			if d.literal("null") {
				out.NonMasqueradeCIDRs = nil
				break
			}
			if list, ok = d.strList(); !ok {
				return false
			}
			listSet = true
		case "masqueradeCIDRs":
			if d.literal("null") {
				break
			}
			if out.MasqueradeCIDRs, ok = d.strList(); !ok {
				return false
			}
		case "masqLinkLocal":
			b, ok := d.bool()
			if !ok {
				return false
			}
			out.MasqLinkLocal = &b
		case "masqLinkLocalIPv6":
			b, ok := d.bool()
			if !ok {
				return false
			}
			out.MasqLinkLocalIPv6 = &b
		case "resyncInterval":
			s, ok := d.str()
			if !ok {
				return false
			}
			out.ResyncInterval = &s
		case "cidrLimit":
			n, ok := d.int()
			if !ok {
				return false
			}
			out.CIDRLimit = &n
		default: // masqueradeRules, or unknown
			return false
		}
		d.space()
		if d.byte('}') {
			break
		}
		if !d.byte(',') {
			return false
		}
	}
	if d.pos != len(data) {
		return false
	}
	if listSet && out.NonMasqueradeCIDRs != nil {
		// decodeJSON fills the slice the caller's pointer points at.
		*out.NonMasqueradeCIDRs = list
	}
	*raw = out
	return true
}

// fastJSON is a cursor over a JSON document for fastDecodeJSON.
type fastJSON struct {
	data []byte
	pos  int
	// text is data as one string, made on the first string read: the
	// strings read are slices of it instead of one allocation each
	// (16 384 of them for a full map). They only live while
	// the file is parsed, so holding the whole text meanwhile costs
	// nothing more.
	text string
}

func (d *fastJSON) peek() byte {
	if d.pos < len(d.data) {
		return d.data[d.pos]
	}
	return 0
}

func (d *fastJSON) space() {
	for d.pos < len(d.data) {
		switch d.data[d.pos] {
		case ' ', '\t', '\n', '\r':
			d.pos++
		default:
			return
		}
	}
}

func (d *fastJSON) byte(b byte) bool {
	if d.peek() != b {
		return false
	}
	d.pos++
	return true
}

func (d *fastJSON) literal(s string) bool {
	if len(d.data)-d.pos < len(s) || string(d.data[d.pos:d.pos+len(s)]) != s {
		return false
	}
	d.pos += len(s)
	return true
}

// str reads a string of printable ASCII without escapes.
func (d *fastJSON) str() (string, bool) {
	if !d.byte('"') {
		return "", false
	}
	start := d.pos
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		switch {
		case c == '"':
			if d.text == "" {
				d.text = string(d.data)
			}
			s := d.text[start:d.pos]
			d.pos++
			return s, true
		case c == '\\' || c < 0x20 || c >= 0x7f:
			return "", false
		}
		d.pos++
	}
	return "", false
}

// strList reads an array of strings; [] gives an empty, non-nil slice, as
// encoding/json does.
func (d *fastJSON) strList() ([]string, bool) {
	if !d.byte('[') {
		return nil, false
	}
	// One string per comma, plus one: sized once for 16 384 prefixes.
	n := 1
	for i := d.pos; i < len(d.data) && d.data[i] != ']'; i++ {
		if d.data[i] == ',' {
			n++
		}
	}
	out := make([]string, 0, n)
	d.space()
	if d.byte(']') {
		return out, true
	}
	for {
		d.space()
		s, ok := d.str()
		if !ok {
			return nil, false
		}
		out = append(out, s)
		d.space()
		if d.byte(']') {
			return out, true
		}
		if !d.byte(',') {
			return nil, false
		}
	}
}

func (d *fastJSON) bool() (bool, bool) {
	switch {
	case d.literal("true"):
		return true, true
	case d.literal("false"):
		return false, true
	}
	return false, false
}

// int reads a plain decimal integer of at most 9 digits (no sign, no
// fraction or exponent), which cannot overflow.
func (d *fastJSON) int() (int, bool) {
	start, n := d.pos, 0
	for d.pos < len(d.data) && d.data[d.pos] >= '0' && d.data[d.pos] <= '9' {
		n = n*10 + int(d.data[d.pos]-'0')
		d.pos++
	}
	digits := d.pos - start
	if digits == 0 || digits > 9 || (digits > 1 && d.data[start] == '0') {
		return 0, false
	}
	return n, true
}
