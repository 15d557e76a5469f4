package k8snode

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
)

// StateFile is the name of the saved copy of the Node's pod CIDRs in
// --state-dir.
const StateFile = "node-pod-cidrs.json"

// savedCIDRs is the copy of the Node's pod CIDRs on disk.
type savedCIDRs struct {
	path string
	last []netip.Prefix
}

type savedFile struct {
	// Node is the Node the ranges belong to: a state directory moved to
	// another node (or a renamed node) must not bring its pools along.
	Node     string         `json:"node"`
	PodCIDRs []netip.Prefix `json:"podCIDRs"`
}

func newSavedCIDRs(stateDir string) *savedCIDRs {
	return &savedCIDRs{path: filepath.Join(stateDir, StateFile)}
}

// load returns the saved ranges of node; none when there is no file.
func (s *savedCIDRs) load(node string) ([]netip.Prefix, error) {
	data, err := os.ReadFile(s.path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read saved pod CIDRs: %w", err)
	}
	var f savedFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("%s: %w", s.path, err)
	}
	if f.Node != node {
		return nil, fmt.Errorf("%s holds the pod CIDRs of Node %q, not of %q", s.path, f.Node, node)
	}
	s.last = f.PodCIDRs
	return f.PodCIDRs, nil
}

// store saves the ranges when they differ from the saved ones: written to
// a temporary file, synced and renamed, so a crash leaves the old or the
// new copy, never a torn one.
func (s *savedCIDRs) store(node string, prefixes []netip.Prefix) error {
	if slices.Equal(s.last, prefixes) {
		return nil
	}
	data, err := json.Marshal(savedFile{Node: node, PodCIDRs: prefixes})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(s.path), 0o700); err != nil {
		return fmt.Errorf("create %s: %w", filepath.Dir(s.path), err)
	}
	tmp := s.path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	_, err = f.Write(append(data, '\n'))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, s.path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("save pod CIDRs to %s: %w", s.path, err)
	}
	s.last = slices.Clone(prefixes)
	return nil
}
