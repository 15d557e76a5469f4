package k8snode

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestSavedCIDRs: the copy on disk comes back for the same Node only, a
// missing file is no error, and a torn file is a clear one.
func TestSavedCIDRs(t *testing.T) {
	dir := t.TempDir()
	s := newSavedCIDRs(dir)
	if got, err := s.load("n1"); err != nil || got != nil {
		t.Fatalf("load without a file: %v, %v", got, err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24"), netip.MustParsePrefix("fd00:10:244:1::/64")}
	if err := s.store("n1", want); err != nil {
		t.Fatal(err)
	}
	got, err := newSavedCIDRs(dir).load("n1")
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("load after store: %v, %v; want %v", got, err, want)
	}
	if _, err := newSavedCIDRs(dir).load("n2"); err == nil || !strings.Contains(err.Error(), `Node "n1", not of "n2"`) {
		t.Fatalf("load for another node: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, StateFile), []byte(`{"node":"n1","podCIDRs":["10.244`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := newSavedCIDRs(dir).load("n1"); err == nil || !strings.Contains(err.Error(), StateFile) {
		t.Fatalf("load of a torn file: %v", err)
	}
}
