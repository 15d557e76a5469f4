package ipam

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestIsStateFileCoversTheStore: once a Store has written a snapshot, its
// backup, a journal, a write in progress and a corrupt snapshot put aside,
// every file in its directory is a state file, and other names are not.
func TestIsStateFileCoversTheStore(t *testing.T) {
	s := newStore(t)
	save(t, s, sampleA())
	save(t, s, sampleB())
	if err := s.Add(ep("10.244.1.9", "ctr-d/eth0", 0, t0)); err != nil {
		t.Fatal(err)
	}
	writeFile(t, s.Path()+".tmp", `{"version": 1, "endpoi`)
	if _, err := s.putAside(); err != nil {
		t.Fatal(err)
	}
	s.Close()
	entries, err := os.ReadDir(filepath.Dir(s.Path()))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
		if !IsStateFile(e.Name()) {
			t.Errorf("the Store wrote %s but IsStateFile says no: uninstall would leave it", e.Name())
		}
	}
	for _, want := range []string{"endpoints.json.bak", "endpoints.journal", "endpoints.json.tmp"} {
		if !slices.Contains(names, want) {
			t.Errorf("the Store wrote %q, not %s: the test does not exercise it", names, want)
		}
	}
	for _, other := range []string{"agent.lock", "node-pod-cidrs.json", "notes.txt", "endpoints.jsonx"} {
		if IsStateFile(other) {
			t.Errorf("IsStateFile(%q) = true, want false", other)
		}
	}
}
