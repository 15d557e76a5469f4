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
	if fastDecodeJSON(data, raw) {
		return nil
	}
	return decodeWithEncodingJSON(path, data, raw)
}

// decodeWithEncodingJSON decodes any JSON config, and names what is wrong
// with a bad one.
func decodeWithEncodingJSON(path string, data []byte, raw *rawFile) error {
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
