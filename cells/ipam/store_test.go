package ipam

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

func newStore(t testing.TB) *Store {
	t.Helper()
	s, err := NewStore(filepath.Join(t.TempDir(), "state"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func ep(ip, owner string, table uint32, created time.Time) *tables.Endpoint {
	return &tables.Endpoint{IP: netip.MustParseAddr(ip), Owner: owner, RouteTable: table, Created: created}
}

var t0 = time.Date(2025, 3, 1, 12, 0, 0, 123456789, time.UTC)

// sampleA and sampleB are two generations of state; A is saved first.
func sampleA() []*tables.Endpoint {
	return []*tables.Endpoint{
		ep("10.244.1.3", "ctr-b/eth0", 0, t0.Add(time.Minute)),
		ep("fd00::2", "ctr-a/eth0", 100, t0),
		ep("10.244.1.2", "ctr-a/eth0", 100, t0),
	}
}

func sampleB() []*tables.Endpoint {
	return append(sampleA(), ep("10.244.1.4", "ctr-c/eth0", 0, t0.Add(time.Hour)))
}

func save(t *testing.T, s *Store, eps []*tables.Endpoint) {
	t.Helper()
	if err := s.Save(eps); err != nil {
		t.Fatalf("Save: %v", err)
	}
}

func load(t *testing.T, s *Store) ([]*tables.Endpoint, LoadReport) {
	t.Helper()
	eps, rep, err := s.Load()
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	return eps, rep
}

// sameEndpoints compares got with want sorted by IP, times with Equal.
func sameEndpoints(t *testing.T, got, want []*tables.Endpoint) {
	t.Helper()
	want = slices.Clone(want)
	slices.SortFunc(want, func(a, b *tables.Endpoint) int { return a.IP.Compare(b.IP) })
	if len(got) != len(want) {
		t.Fatalf("got %d endpoints %v, want %d", len(got), got, len(want))
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.IP != w.IP || g.Owner != w.Owner || g.RouteTable != w.RouteTable || !g.Created.Equal(w.Created) {
			t.Errorf("endpoint %d = %+v, want %+v", i, *g, *w)
		}
	}
}

// dirNames lists the store's directory.
func dirNames(t *testing.T, s *Store) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Dir(s.Path()))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

func corruptNames(t *testing.T, s *Store) []string {
	t.Helper()
	var out []string
	for _, n := range dirNames(t, s) {
		if strings.HasPrefix(n, "endpoints.json.corrupt-") {
			out = append(out, n)
		}
	}
	return out
}

func writeFile(t *testing.T, name, data string) {
	t.Helper()
	if err := os.WriteFile(name, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
}

// stateWithChecksum is a version-1 file whose checksum matches arr, for
// testing the checks behind the checksum.
func stateWithChecksum(version int, arr string) string {
	sum := sha256.Sum256([]byte(arr))
	return fmt.Sprintf(`{"version": %d, "endpoints": %s, "sha256": %q}`, version, arr, hex.EncodeToString(sum[:]))
}

func TestStoreEmpty(t *testing.T) {
	s := newStore(t)
	if want := filepath.Join(filepath.Dir(s.Path()), "endpoints.json"); s.Path() != want {
		t.Errorf("Path() = %s, want %s", s.Path(), want)
	}
	eps, rep := load(t, s)
	if len(eps) != 0 || rep.Origin != "none" || len(rep.Problems) != 0 {
		t.Errorf("Load of an empty dir = %v, %+v; want nothing, Source none", eps, rep)
	}

	// An empty table saves and loads as such, from the file.
	save(t, s, nil)
	eps, rep = load(t, s)
	if len(eps) != 0 || rep.Origin != "file" {
		t.Errorf("Load after Save(nil) = %v, %+v; want nothing, Source file", eps, rep)
	}
}

func TestStoreRoundTrip(t *testing.T) {
	s := newStore(t)
	in := sampleA()
	local := time.FixedZone("CET", 3600)
	in[0].Created = in[0].Created.In(local) // zones need not survive, instants must
	save(t, s, in)
	eps, rep := load(t, s)
	if rep.Origin != "file" || len(rep.Problems) != 0 {
		t.Errorf("report %+v, want Source file and no problems", rep)
	}
	sameEndpoints(t, eps, in)

	// Save did not reorder the caller's slice.
	if in[0].IP != netip.MustParseAddr("10.244.1.3") {
		t.Errorf("Save reordered its argument")
	}

	// The file is sorted by IP, one endpoint per line, and says its version.
	data, err := os.ReadFile(s.Path())
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	i2, i3, i6 := strings.Index(text, `"10.244.1.2"`), strings.Index(text, `"10.244.1.3"`), strings.Index(text, `"fd00::2"`)
	if !(0 < i2 && i2 < i3 && i3 < i6) {
		t.Errorf("endpoints not sorted by IP:\n%s", text)
	}
	if !strings.Contains(text, `"version": 2,`) || !strings.Contains(text, `"journalSeq": 0,`) || !strings.Contains(text, `"routeTable":100`) {
		t.Errorf("unexpected file format:\n%s", text)
	}
	t.Logf("state file:\n%s", text)
}

func TestStoreFileModes(t *testing.T) {
	s := newStore(t)
	save(t, s, sampleA())
	save(t, s, sampleB())
	for _, name := range []string{s.Path(), s.Path() + ".bak", s.JournalPath()} {
		fi, err := os.Stat(name)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v, want 0600", name, fi.Mode().Perm())
		}
	}
	fi, err := os.Stat(filepath.Dir(s.Path()))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o700 {
		t.Errorf("state dir has mode %v, want 0700", fi.Mode().Perm())
	}

	// A stale .tmp with a loose mode does not pass it on.
	tmp := s.Path() + ".tmp"
	writeFile(t, tmp, "junk")
	if err := os.Chmod(tmp, 0o644); err != nil {
		t.Fatal(err)
	}
	save(t, s, sampleA())
	if fi, err := os.Stat(s.Path()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("after a stale 0644 .tmp: %v, %v; want mode 0600", fi.Mode(), err)
	}
	if got := dirNames(t, s); !slices.Equal(got, []string{"endpoints.journal", "endpoints.json", "endpoints.json.bak"}) {
		t.Errorf("after Save the directory holds %v", got)
	}
}

func TestStoreBackupIsPreviousSave(t *testing.T) {
	s := newStore(t)
	save(t, s, sampleA())
	if _, err := os.Stat(s.Path() + ".bak"); !os.IsNotExist(err) {
		t.Errorf("first Save made a backup (%v); there was nothing to back up", err)
	}
	save(t, s, sampleB())
	eps, _, err := readState(s.Path() + ".bak")
	if err != nil {
		t.Fatal(err)
	}
	sameEndpoints(t, eps, sampleA())
}

// A crash after the .tmp was written but before it was renamed leaves the
// old state in place; the .tmp is ignored.
func TestStoreCrashLeavesTmp(t *testing.T) {
	s := newStore(t)
	writeFile(t, s.Path()+".tmp", `{"version": 1, "endpoi`)
	eps, rep := load(t, s)
	if len(eps) != 0 || rep.Origin != "none" {
		t.Errorf("with only a .tmp: %v, %+v; want nothing, Source none", eps, rep)
	}

	save(t, s, sampleA())
	writeFile(t, s.Path()+".tmp", `{"version": 1, "endpoi`)
	eps, rep = load(t, s)
	if rep.Origin != "file" || len(rep.Problems) != 0 {
		t.Errorf("report %+v, want Source file", rep)
	}
	sameEndpoints(t, eps, sampleA())
}

// With only the backup (the file was put aside by an earlier Load, then
// the agent stopped before saving), the backup is used and Load says so.
func TestStoreOnlyBackup(t *testing.T) {
	s := newStore(t)
	save(t, s, sampleA())
	save(t, s, sampleB())
	if err := os.Remove(s.Path()); err != nil {
		t.Fatal(err)
	}
	eps, rep := load(t, s)
	if rep.Origin != "backup" || len(rep.Problems) != 1 || !strings.Contains(rep.Problems[0], "endpoints.json does not exist") {
		t.Errorf("report %+v, want Source backup and a problem about the missing file", rep)
	}
	sameEndpoints(t, eps, sampleA())

	// The next save writes the file and keeps the backup.
	save(t, s, sampleB())
	eps, rep = load(t, s)
	if rep.Origin != "file" {
		t.Errorf("after Save: Source %s, want file", rep.Origin)
	}
	sameEndpoints(t, eps, sampleB())
}

// corruptions turn a saved file into a bad one; Load must fall back.
var corruptions = []struct {
	name    string
	corrupt func(data []byte) []byte
	problem string
}{
	{"truncated", func(d []byte) []byte { return d[:len(d)/2] }, "not valid JSON (file truncated or modified)"},
	{"empty", func(d []byte) []byte { return nil }, "empty file"},
	{"zeroes", func(d []byte) []byte { return make([]byte, len(d)) }, "not valid JSON"},
	{"byte flipped", func(d []byte) []byte {
		i := strings.Index(string(d), "ctr-b")
		d[i] = 'x' // still valid JSON, different owner
		return d
	}, "checksum mismatch (file truncated or modified)"},
	{"checksum edited", func(d []byte) []byte {
		i := strings.Index(string(d), `"sha256": "`) + len(`"sha256": "`)
		d[i] ^= 1
		return d
	}, "checksum mismatch"},
}

func TestStoreCorruptFileUsesBackup(t *testing.T) {
	for _, c := range corruptions {
		t.Run(c.name, func(t *testing.T) {
			s := newStore(t)
			save(t, s, sampleA())
			save(t, s, sampleB())
			data, err := os.ReadFile(s.Path())
			if err != nil {
				t.Fatal(err)
			}
			bad := c.corrupt(data)
			writeFile(t, s.Path(), string(bad))

			eps, rep := load(t, s)
			sameEndpoints(t, eps, sampleA())
			if rep.Origin != "backup" {
				t.Errorf("Source %q, want backup", rep.Origin)
			}
			all := strings.Join(rep.Problems, "\n")
			if !strings.Contains(all, s.Path()+": "+c.problem) {
				t.Errorf("problems %q do not say %q", all, s.Path()+": "+c.problem)
			}

			// The bad file is kept aside, byte for byte, and named in the report.
			aside := corruptNames(t, s)
			if len(aside) != 1 {
				t.Fatalf("corrupt files %v, want one", aside)
			}
			if !strings.Contains(all, aside[0]) {
				t.Errorf("problems %q do not name %s", all, aside[0])
			}
			kept, err := os.ReadFile(filepath.Join(filepath.Dir(s.Path()), aside[0]))
			if err != nil || string(kept) != string(bad) {
				t.Errorf("kept file differs from the bad one (%v)", err)
			}
			if _, err := os.Stat(s.Path()); !os.IsNotExist(err) {
				t.Errorf("bad file still in place: %v", err)
			}

			// Loading again uses the backup again; the next save recovers
			// and keeps the good backup.
			if _, rep := load(t, s); rep.Origin != "backup" {
				t.Errorf("second Load: Source %s, want backup", rep.Origin)
			}
			save(t, s, sampleB())
			eps, rep = load(t, s)
			if rep.Origin != "file" {
				t.Errorf("after Save: Source %s, want file", rep.Origin)
			}
			sameEndpoints(t, eps, sampleB())
			bak, _, err := readState(s.Path() + ".bak")
			if err != nil {
				t.Fatalf("backup after recovery: %v", err)
			}
			sameEndpoints(t, bak, sampleA())
		})
	}
}

func TestStoreBothBad(t *testing.T) {
	tests := []struct {
		name      string
		file, bak *string
		want      []string
	}{
		{"both corrupt", ptr(`{"version": 1, "endp`), ptr(stateWithChecksum(1, `[]`)[:20]),
			[]string{"endpoints.json: not valid JSON", "endpoints.json.bak: not valid JSON"}},
		{"corrupt, no backup", ptr(`garbage`), nil,
			[]string{"endpoints.json: not valid JSON", "endpoints.json.bak: does not exist"}},
		{"missing, corrupt backup", nil, ptr(`{"version": 1, "endpoints": [], "sha256": "00"}`),
			[]string{"endpoints.json: does not exist", "endpoints.json.bak: checksum mismatch"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t)
			if tt.file != nil {
				writeFile(t, s.Path(), *tt.file)
			}
			if tt.bak != nil {
				writeFile(t, s.Path()+".bak", *tt.bak)
			}
			before := dirNames(t, s)
			eps, _, err := s.Load()
			if err == nil {
				t.Fatalf("Load succeeded with %v; want an error", eps)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if after := dirNames(t, s); !slices.Equal(before, after) {
				t.Errorf("Load changed the directory from %v to %v", before, after)
			}
			if tt.file != nil {
				if data, _ := os.ReadFile(s.Path()); string(data) != *tt.file {
					t.Errorf("Load changed the file")
				}
			}
			t.Log(err)
		})
	}
}

func ptr(s string) *string { return &s }

func TestStoreInvalidContent(t *testing.T) {
	const created = `"created":"2025-03-01T12:00:00Z"`
	tests := []struct {
		name, file, problem string
	}{
		{"bad ip", stateWithChecksum(1, `[{"ip":"10.244.1.300","owner":"a",`+created+`}]`),
			`invalid endpoints`},
		{"no ip", stateWithChecksum(1, `[{"ip":"","owner":"a",`+created+`}]`),
			`endpoint 0 (owner "a") has no valid ip`},
		{"mapped ip", stateWithChecksum(1, `[{"ip":"::ffff:10.244.1.2","owner":"a",`+created+`}]`),
			`ip ::ffff:10.244.1.2 is IPv4-mapped`},
		{"empty owner", stateWithChecksum(1, `[{"ip":"10.244.1.2","owner":"",`+created+`}]`),
			`endpoint 0 (ip 10.244.1.2) has an empty owner`},
		{"duplicate ip", stateWithChecksum(1, `[{"ip":"10.244.1.2","owner":"a",`+created+`},{"ip":"10.244.1.2","owner":"b",`+created+`}]`),
			`ip 10.244.1.2 is allocated twice, to "a" and "b"`},
		{"two ipv4 for one owner", stateWithChecksum(1, `[{"ip":"10.244.1.2","owner":"a",`+created+`},{"ip":"10.244.1.3","owner":"a",`+created+`}]`),
			`owner "a" holds two ipv4 addresses, 10.244.1.2 and 10.244.1.3`},
		{"null endpoint", stateWithChecksum(1, `[null]`), `endpoint 0 is null`},
		{"endpoints not an array", stateWithChecksum(1, `{}`), `invalid endpoints`},
		{"no version", `{"endpoints": [], "sha256": ""}`, `no "version" field`},
		{"no checksum", `{"version": 1, "endpoints": []}`, `no "sha256" field`},
		{"no endpoints", `{"version": 1, "sha256": ""}`, `no "endpoints" field`},
		{"not an object", `[]`, `not valid JSON`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t)
			save(t, s, sampleA())
			save(t, s, sampleB()) // the backup is now sampleA
			writeFile(t, s.Path(), tt.file)
			eps, rep := load(t, s)
			sameEndpoints(t, eps, sampleA())
			if rep.Origin != "backup" || len(rep.Problems) == 0 || !strings.Contains(rep.Problems[0], s.Path()+": ") ||
				!strings.Contains(rep.Problems[0], tt.problem) {
				t.Errorf("report %+v, want Source backup and a problem naming the file and saying %q", rep, tt.problem)
			}
			if n := corruptNames(t, s); len(n) != 1 {
				t.Errorf("corrupt files %v, want one", n)
			}
		})
	}

	// A dual-stack owner holds one address of each family.
	s := newStore(t)
	writeFile(t, s.Path(), stateWithChecksum(1, `[{"ip":"10.244.1.2","owner":"a",`+created+`},{"ip":"fd00::2","owner":"a",`+created+`}]`))
	if eps, rep := load(t, s); len(eps) != 2 || rep.Origin != "file" {
		t.Errorf("dual-stack owner: %v, %+v", eps, rep)
	}
}

// A file of another version is not damaged: it was written by another
// ipmasq. Load refuses it without falling back to an older backup, and
// leaves it in place.
func TestStoreUnknownVersion(t *testing.T) {
	s := newStore(t)
	save(t, s, sampleA())
	save(t, s, sampleB())
	writeFile(t, s.Path(), stateWithChecksum(3, `[]`))
	before := dirNames(t, s)
	_, _, err := s.Load()
	want := s.Path() + ": unsupported version 3: this ipmasq reads versions 1 and 2 only"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Load: %v, want an error saying %q", err, want)
	}
	if after := dirNames(t, s); !slices.Equal(before, after) {
		t.Errorf("Load changed the directory from %v to %v", before, after)
	}
}

func TestStoreSaveRejectsInvalid(t *testing.T) {
	s := newStore(t)
	save(t, s, sampleA())
	tests := []struct {
		name string
		eps  []*tables.Endpoint
		want string
	}{
		{"duplicate ip", []*tables.Endpoint{ep("10.244.1.2", "a", 0, t0), ep("10.244.1.2", "b", 0, t0)}, "allocated twice"},
		{"empty owner", []*tables.Endpoint{ep("10.244.1.2", "", 0, t0)}, "empty owner"},
		{"zero ip", []*tables.Endpoint{{Owner: "a"}}, "no valid ip"},
		{"two per family", []*tables.Endpoint{ep("fd00::2", "a", 0, t0), ep("fd00::3", "a", 0, t0)}, "holds two ipv6 addresses"},
	}
	for _, tt := range tests {
		err := s.Save(tt.eps)
		if err == nil || !strings.Contains(err.Error(), "refusing to save "+s.Path()) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: Save: %v, want refusal saying %q", tt.name, err, tt.want)
		}
	}
	// Nothing was written.
	eps, rep := load(t, s)
	if rep.Origin != "file" {
		t.Errorf("Source %s, want file", rep.Origin)
	}
	sameEndpoints(t, eps, sampleA())
	if _, err := os.Stat(s.Path() + ".bak"); !os.IsNotExist(err) {
		t.Errorf("a refused Save made a backup: %v", err)
	}
}

// BenchmarkSave saves 1000 endpoints; each op includes two fsyncs (file
// and directory), which is the price of durability and dominates.
func BenchmarkSave(b *testing.B) {
	s := newStore(b)
	eps := make([]*tables.Endpoint, 0, 1000)
	ip := netip.MustParseAddr("10.244.0.1")
	for i := range 1000 {
		eps = append(eps, &tables.Endpoint{
			IP:         ip,
			Owner:      fmt.Sprintf("default/pod-%d/eth0", i),
			RouteTable: uint32(100 + i%4),
			Created:    t0.Add(time.Duration(i) * time.Second),
		})
		ip = ip.Next()
	}
	for b.Loop() {
		if err := s.Save(eps); err != nil {
			b.Fatal(err)
		}
	}
	if fi, err := os.Stat(s.Path()); err == nil {
		b.ReportMetric(float64(fi.Size()), "file-bytes")
	}
}
