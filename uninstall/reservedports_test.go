package uninstall

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/reconcilers/datapath"
)

// TestRemoveOldReservation: the uninstall takes back the reservation an
// older agent made (its NAT range appended to ip_local_reserved_ports),
// recognised as an item of the list equal to one of the agent's ranges on
// a node where ipmasq was installed, and leaves everything else: the
// operator's items, a range merged with the operator's, a list on a node
// without ipmasq. (A file it cannot write, /proc/sys read-only as in the
// Job's container: e2e TestUninstallTakesBackOldReservation.)
func TestRemoveOldReservation(t *testing.T) {
	def := datapath.PortRanges{{Min: 61000, Max: 65535}}
	two := datapath.PortRanges{{Min: 1024, Max: 29999}, {Min: 32768, Max: 65535}}
	for _, tc := range []struct {
		name      string
		list      string
		ranges    datapath.PortRanges
		installed bool
		want      string // the file afterwards
		reported  int
		noted     string
	}{
		{"the default range alone", "61000-65535\n", def, true, "\n", 1, ""},
		{"beside the operator's", "8080,61000-65535\n", def, true, "8080\n", 1, ""},
		{"two ranges of --to-ports", "1024-29999,32768-65535\n", two, true, "\n", 2, ""},
		{"merged with the operator's", "60000-65535\n", def, true, "60000-65535\n", 0, "covers a NAT port range"},
		{"another range", "8080,40000-40100\n", def, true, "8080,40000-40100\n", 0, ""},
		{"not installed here", "61000-65535\n", def, false, "61000-65535\n", 0, ""},
		{"empty", "\n", def, true, "\n", 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ip_local_reserved_ports")
			if err := os.WriteFile(path, []byte(tc.list), 0o644); err != nil {
				t.Fatal(err)
			}
			var reports, notes []string
			err := removeOldReservation(path, tc.ranges, tc.installed,
				func(s string) { reports = append(reports, s) }, func(s string) { notes = append(notes, s) })
			if err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(path)
			if string(got) != tc.want || len(reports) != tc.reported {
				t.Fatalf("file %q, reports %q; want %q and %d reports", got, reports, tc.want, tc.reported)
			}
			if tc.noted == "" && len(notes) != 0 || tc.noted != "" && (len(notes) != 1 || !strings.Contains(notes[0], tc.noted)) {
				t.Fatalf("notes %q, want %q", notes, tc.noted)
			}
		})
	}

}
