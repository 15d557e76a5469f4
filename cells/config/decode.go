package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"
)

// yamlSyntaxError is a YAML document that could not be read at all.
type yamlSyntaxError struct{ error }

// decode fills raw from JSON (when data starts with '{') or YAML. absent is
// the sentinel Parse put in raw.NonMasqueradeCIDRs. It returns the
// top-level keys the format does not know, sorted: they are ignored, as the
// Kubernetes agent ignores them, and the caller warns about them. Unknown
// keys inside masqueradeRules entries (ipmasq's own extension) are errors.
func decode(path string, data []byte, raw *rawFile, absent *[]string) ([]string, error) {
	if data[0] == '{' {
		unknown, err := decodeJSON(path, data, raw, absent)
		var se *json.SyntaxError
		if !errors.As(err, &se) {
			return unknown, err
		}
		// Not JSON; it may be a YAML flow mapping such as
		// {nonMasqueradeCIDRs: [10.0.0.0/8]}.
		resetRaw(raw, absent)
		unknown, yerr := decodeYAML(path, data, raw, absent)
		if ys := (yamlSyntaxError{}); errors.As(yerr, &ys) {
			// Neither; the author most likely meant JSON.
			line, col := lineCol(data, se.Offset-1) // Offset is just past the bad byte
			return nil, fmt.Errorf("%s: invalid JSON at line %d, column %d: %s", path, line, col,
				strings.TrimPrefix(se.Error(), "json: "))
		}
		return unknown, yerr
	}
	return decodeYAML(path, data, raw, absent)
}

// resetRaw empties raw for another decoding pass, with the absent sentinel.
func resetRaw(raw *rawFile, absent *[]string) {
	*raw = rawFile{NonMasqueradeCIDRs: absent}
	*absent = nil
}

func decodeJSON(path string, data []byte, raw *rawFile, absent *[]string) ([]string, error) {
	if fastDecodeJSON(data, raw) {
		return nil, nil
	}
	return decodeWithEncodingJSON(path, data, raw, absent)
}

// decodeWithEncodingJSON decodes any JSON config, and names what is wrong
// with a bad one. Unknown top-level keys are returned, not refused.
func decodeWithEncodingJSON(path string, data []byte, raw *rawFile, absent *[]string) ([]string, error) {
	err := decodeEncodingJSON(path, data, raw, true)
	if !errors.As(err, new(unknownFieldError)) {
		return nil, err
	}
	unknown := unknownTopLevelKeys(data)
	if len(unknown) == 0 {
		return nil, err // the unknown key is in a masqueradeRules entry
	}
	resetRaw(raw, absent)
	if err := decodeEncodingJSON(path, data, raw, false); err != nil {
		return nil, err
	}
	if err := strictRules(path, data, true); err != nil {
		return nil, err
	}
	return unknown, nil
}

// decodeEncodingJSON is one encoding/json pass over data; strict refuses
// unknown keys at any depth (an unknownFieldError).
func decodeEncodingJSON(path string, data []byte, raw *rawFile, strict bool) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	if strict {
		dec.DisallowUnknownFields()
	}
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

func decodeYAML(path string, data []byte, raw *rawFile, absent *[]string) ([]string, error) {
	if line := secondYAMLDocument(data); line > 0 {
		return nil, fmt.Errorf("%s: line %d: a second YAML document starts here; put all keys in one document", path, line)
	}
	err := yamlError(path, data, yaml.UnmarshalStrict(data, raw))
	if !errors.As(err, new(unknownFieldError)) {
		return nil, err
	}
	// The strict pass read the document, so it converts.
	j, jerr := yaml.YAMLToJSON(data)
	if jerr != nil {
		return nil, err
	}
	unknown := unknownTopLevelKeys(j)
	if len(unknown) == 0 {
		return nil, err // the unknown key is in a masqueradeRules entry
	}
	resetRaw(raw, absent)
	// yaml.Unmarshal, not a decoding of j: it coerces scalars to the
	// field's type as the strict pass does (resyncInterval: 60 is "60").
	if err := yamlError(path, data, yaml.Unmarshal(data, raw)); err != nil {
		return nil, err
	}
	if err := strictRules(path, j, false); err != nil {
		return nil, err
	}
	return unknown, nil
}

// yamlError turns an error of sigs.k8s.io/yaml into an operator message.
func yamlError(path string, data []byte, err error) error {
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

// unknownTopLevelKeys returns the keys of the JSON object data that match
// no key of the format (case-insensitively, as encoding/json matches
// them), sorted; nil when data is not an object.
func unknownTopLevelKeys(data []byte) []string {
	var top map[string]json.RawMessage
	if json.Unmarshal(data, &top) != nil {
		return nil
	}
	var unknown []string
	for k := range top {
		if !slices.ContainsFunc(jsonKeys[rawFile](), func(known string) bool { return strings.EqualFold(k, known) }) {
			unknown = append(unknown, k)
		}
	}
	slices.Sort(unknown)
	return unknown
}

// strictRules refuses an unknown key in a masqueradeRules entry of the
// JSON data (the file, or a YAML file converted), which a pass that ignores
// the unknown top-level keys let through.
func strictRules(path string, data []byte, isJSON bool) error {
	var top struct {
		Rules []json.RawMessage `json:"masqueradeRules"`
	}
	if json.Unmarshal(data, &top) != nil {
		return nil // the pass before decoded the file
	}
	for _, r := range top.Rules {
		dec := json.NewDecoder(bytes.NewReader(r))
		dec.DisallowUnknownFields()
		var rule rawRule
		if err := dec.Decode(&rule); err != nil {
			if err := decodeError(path, err, data, isJSON); errors.As(err, new(unknownFieldError)) {
				return err
			}
		}
	}
	return nil
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
