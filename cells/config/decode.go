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

	"github.com/ipmasq/ipmasq/tables"
)

// yamlSyntaxError is a YAML document that could not be read at all.
type yamlSyntaxError struct{ error }

// decode fills raw from data as the Kubernetes agent reads its file, in
// one pipeline: JSON when data starts with '{' (k8s.io/apimachinery's
// yaml.ToJSON passes it through), otherwise YAML converted to JSON by
// sigs.k8s.io/yaml.YAMLToJSON (the first document only, a repeated key's
// last value); then one JSON decoding (encoding/json: a repeated key's
// last value, keys matched case-insensitively). absent is the sentinel
// parse put in raw.NonMasqueradeCIDRs. It returns the top-level keys the
// format does not know, sorted: they are ignored, as the Kubernetes agent
// ignores them, and the caller warns about them. Unknown keys inside
// masqueradeRules entries (ipmasq's own extension) are errors. warnings
// name what the agent read differently from what the file seems to say.
func decode(path string, data []byte, raw *rawFile, absent *[]string) (unknown []string, warnings []tables.ConfigWarning, err error) {
	if data[0] != '{' {
		j, warnings, err := yamlToJSON(path, data)
		if err != nil {
			return nil, nil, err
		}
		unknown, err := decodeJSON(path, j, raw, absent, false)
		return unknown, warnings, err
	}
	unknown, err = decodeJSON(path, data, raw, absent, true)
	var se *json.SyntaxError
	if !errors.As(err, &se) {
		if err == nil {
			if key, ok := jsonDuplicateKey(data); ok {
				warnings = append(warnings, oddWarning("%s: key %s is set more than once in one object; the last value is used, as the Kubernetes agent uses it", path, quote(key)))
			}
		}
		return unknown, warnings, err
	}
	// Not JSON; it may be a YAML flow mapping such as
	// {nonMasqueradeCIDRs: [10.0.0.0/8]}, which the Kubernetes agent
	// refuses as JSON.
	resetRaw(raw, absent)
	j, warnings, yerr := yamlToJSON(path, data)
	if ys := (yamlSyntaxError{}); yerr == nil || !errors.As(yerr, &ys) {
		if yerr == nil {
			unknown, yerr = decodeJSON(path, j, raw, absent, false)
		}
		if yerr == nil {
			warnings = append(warnings, oddWarning("%s: not JSON but a YAML flow mapping, read as YAML (the Kubernetes agent takes a file starting with '{' for JSON and refuses this one)", path))
		}
		return unknown, warnings, yerr
	}
	// Neither; the author most likely meant JSON.
	line, col := lineCol(data, se.Offset-1) // Offset is just past the bad byte
	return nil, nil, fmt.Errorf("%s: invalid JSON at line %d, column %d: %s", path, line, col,
		strings.TrimPrefix(se.Error(), "json: "))
}

// oddWarning is a warning about a file read as the Kubernetes agent reads
// it, where the file most likely does not say what its author meant.
func oddWarning(format string, args ...any) tables.ConfigWarning {
	return tables.ConfigWarning{Kind: tables.ConfigWarningOdd, Message: fmt.Sprintf(format, args...)}
}

// yamlToJSON converts a YAML file to JSON as the Kubernetes agent does
// (sigs.k8s.io/yaml.YAMLToJSON), warning about what that conversion
// drops: a second document, and the earlier values of a repeated key.
func yamlToJSON(path string, data []byte) ([]byte, []tables.ConfigWarning, error) {
	var warnings []tables.ConfigWarning
	if line := secondYAMLDocument(data); line > 0 {
		warnings = append(warnings, oddWarning("%s: line %d: a second YAML document starts here and is ignored, as the Kubernetes agent reads only the first; put all keys in one document", path, line))
	}
	// The strict conversion costs the same and refuses only repeated keys.
	j, err := yaml.YAMLToJSONStrict(data)
	if err == nil {
		return j, warnings, nil
	}
	j, lerr := yaml.YAMLToJSON(data)
	if lerr != nil {
		return nil, nil, yamlError(path, lerr)
	}
	msg := strings.TrimPrefix(err.Error(), "error converting YAML to JSON: ")
	msg = strings.TrimPrefix(msg, "yaml: ")
	msg = strings.TrimPrefix(msg, "unmarshal errors:")
	return j, append(warnings, oddWarning("%s: %s; the last value is used, as the Kubernetes agent uses it", path, oneLine(msg))), nil
}

// resetRaw empties raw for another decoding pass, with the absent sentinel.
func resetRaw(raw *rawFile, absent *[]string) {
	*raw = rawFile{NonMasqueradeCIDRs: absent}
	*absent = nil
}

// decodeJSON decodes the JSON data (the file, or a YAML file converted;
// isJSON says which, for the positions in errors) into raw and returns the
// unknown top-level keys. Unknown top-level keys are returned, not
// refused.
func decodeJSON(path string, data []byte, raw *rawFile, absent *[]string, isJSON bool) ([]string, error) {
	if fastDecodeJSON(data, raw) {
		return nil, nil
	}
	return decodeWithEncodingJSON(path, data, raw, absent, isJSON)
}

// decodeWithEncodingJSON is decodeJSON without the fast path: it decodes
// any JSON config and names what is wrong with a bad one.
func decodeWithEncodingJSON(path string, data []byte, raw *rawFile, absent *[]string, isJSON bool) ([]string, error) {
	err := decodeEncodingJSON(path, data, raw, true, isJSON)
	if !errors.As(err, new(unknownFieldError)) {
		return nil, err
	}
	unknown := unknownTopLevelKeys(data)
	if len(unknown) == 0 {
		return nil, err // the unknown key is in a masqueradeRules entry
	}
	resetRaw(raw, absent)
	if err := decodeEncodingJSON(path, data, raw, false, isJSON); err != nil {
		return nil, err
	}
	if err := strictRules(path, data, isJSON); err != nil {
		return nil, err
	}
	return unknown, nil
}

// decodeEncodingJSON is one encoding/json pass over data; strict refuses
// unknown keys at any depth (an unknownFieldError).
func decodeEncodingJSON(path string, data []byte, raw *rawFile, strict, isJSON bool) error {
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
		return decodeError(path, err, data, isJSON)
	}
	if off := dec.InputOffset(); len(bytes.TrimSpace(data[off:])) != 0 {
		line, col := lineCol(data, off+int64(len(data[off:])-len(bytes.TrimLeft(data[off:], " \t\r\n"))))
		return fmt.Errorf("%s: invalid JSON at line %d, column %d: unexpected data after the top-level object", path, line, col)
	}
	return nil
}

// yamlError turns an error of sigs.k8s.io/yaml's conversion to JSON, a
// document that could not be read, into an operator message.
func yamlError(path string, err error) error {
	msg := strings.TrimPrefix(err.Error(), "error converting YAML to JSON: ")
	msg = strings.TrimPrefix(msg, "yaml: ")
	msg = strings.TrimPrefix(msg, "unmarshal errors:")
	return yamlSyntaxError{fmt.Errorf("%s: invalid YAML: %s", path, oneLine(msg))}
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

// secondYAMLDocument returns the 1-based line of the "---" marker that
// starts a second document with content after it, or 0. YAMLToJSON reads
// only the first document (an empty one when the file starts with two
// markers), so the rest of the file is dropped.
func secondYAMLDocument(data []byte) int {
	started := false // the first document began: a marker or content
	marker := 0      // the line of the second document's marker
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
			if started && marker == 0 {
				marker = line
			}
			started = true
			l = l[3:]
		}
		if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' {
			if marker > 0 {
				return marker
			}
			started = true
		}
	}
	return 0
}

// jsonDuplicateKey reports the first key that appears twice in one object of
// data, which must be valid JSON. encoding/json keeps the last value, as
// the Kubernetes agent does; the caller warns.
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
