package ipam

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

// loaded is a store on a fresh directory, loaded and ready for changes.
func loaded(t *testing.T) *Store {
	t.Helper()
	s := newStore(t)
	load(t, s)
	t.Cleanup(func() { s.Close() })
	return s
}

// reopen is a restart: a new Store on the same directory, loaded.
func reopen(t *testing.T, s *Store) ([]*tables.Endpoint, LoadReport) {
	t.Helper()
	s2, err := NewStore(filepath.Dir(s.Path()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s2.Close() })
	return load(t, s2)
}

func add(t *testing.T, s *Store, eps ...*tables.Endpoint) {
	t.Helper()
	for _, ep := range eps {
		if err := s.Add(ep); err != nil {
			t.Fatalf("Add %s: %v", ep.IP, err)
		}
	}
}

func del(t *testing.T, s *Store, ips ...string) {
	t.Helper()
	for _, ip := range ips {
		if err := s.Delete(netip.MustParseAddr(ip)); err != nil {
			t.Fatalf("Delete %s: %v", ip, err)
		}
	}
}

func journalLines(t *testing.T, s *Store) []string {
	t.Helper()
	data, err := os.ReadFile(s.JournalPath())
	if err != nil {
		t.Fatal(err)
	}
	return strings.SplitAfter(string(data), "\n")[:strings.Count(string(data), "\n")]
}

// snapshotSeq is the journalSeq of a snapshot file.
func snapshotSeq(t *testing.T, name string) uint64 {
	t.Helper()
	_, seq, err := readState(name)
	if err != nil {
		t.Fatal(err)
	}
	return seq
}

func TestJournalReplayAfterRestart(t *testing.T) {
	s := loaded(t)
	add(t, s, sampleA()...)
	add(t, s, ep("10.244.1.9", "ctr-z/eth0", 7, t0))
	del(t, s, "10.244.1.9", "10.244.1.3")
	// The address goes to another owner: the last record wins.
	add(t, s, ep("10.244.1.3", "ctr-y/eth0", 0, t0))
	want := append(sampleA()[1:], ep("10.244.1.3", "ctr-y/eth0", 0, t0))

	// Nothing but the journal was written since Load.
	if _, err := os.Stat(s.Path()); !os.IsNotExist(err) {
		t.Fatalf("a change wrote the snapshot: %v", err)
	}
	lines := journalLines(t, s)
	if len(lines) != 7 {
		t.Fatalf("journal has %d lines, want 7:\n%s", len(lines), strings.Join(lines, ""))
	}
	for i, l := range lines {
		if _, err := decodeRecord([]byte(strings.TrimSuffix(l, "\n"))); err != nil || !strings.Contains(l, fmt.Sprintf(`{"seq":%d,"op":"`, i+1)) {
			t.Errorf("line %d %q: %v", i+1, l, err)
		}
	}
	t.Logf("journal:\n%s", strings.Join(lines, ""))

	eps, rep := reopen(t, s)
	sameEndpoints(t, eps, want)
	if rep.Origin != "none" || rep.Replayed != 7 || len(rep.Problems) != 0 {
		t.Errorf("report %+v, want Source none, 7 replayed, no problems", rep)
	}
}

func TestJournalRefusesInvalidChange(t *testing.T) {
	s := loaded(t)
	add(t, s, sampleA()...)
	before := journalLines(t, s)
	for _, tt := range []struct {
		name string
		err  error
		want string
	}{
		{"taken ip", s.Add(ep("10.244.1.2", "other", 0, t0)), `ip 10.244.1.2 is already allocated to "ctr-a/eth0"`},
		{"second ipv4", s.Add(ep("10.244.1.8", "ctr-a/eth0", 0, t0)), `owner "ctr-a/eth0" already holds the ipv4 address 10.244.1.2`},
		{"empty owner", s.Add(ep("10.244.1.8", "", 0, t0)), "empty owner"},
		{"mapped ip", s.Add(ep("::ffff:10.244.1.8", "x", 0, t0)), "IPv4-mapped"},
		{"free ip", s.Delete(netip.MustParseAddr("10.244.1.8")), "ip 10.244.1.8 is not allocated"},
	} {
		if tt.err == nil || !strings.Contains(tt.err.Error(), "refusing to journal") || !strings.Contains(tt.err.Error(), tt.want) {
			t.Errorf("%s: %v, want a refusal saying %q", tt.name, tt.err, tt.want)
		}
	}
	if after := journalLines(t, s); !slices.Equal(before, after) {
		t.Errorf("a refused change was written")
	}
	// Changes need a loaded store.
	s2, _ := NewStore(t.TempDir())
	if err := s2.Add(ep("10.244.1.8", "x", 0, t0)); err == nil || !strings.Contains(err.Error(), "before the state was loaded") {
		t.Errorf("Add before Load: %v", err)
	}
	s.Close()
	if err := s.Add(ep("10.244.1.8", "x", 0, t0)); err == nil || !strings.Contains(err.Error(), "store closed") {
		t.Errorf("Add after Close: %v", err)
	}
}

// A crash while a line was being written leaves a torn last line: the
// change was never acknowledged. It is dropped, reported and cut off, so
// that the next append does not land behind it.
func TestJournalTornLastLine(t *testing.T) {
	for _, tt := range []struct {
		name string
		tear func(last []byte) []byte
		want string
	}{
		{"half written", func(l []byte) []byte { return l[:len(l)/2] }, "incomplete record (no end of line)"},
		{"no newline", func(l []byte) []byte { return l[:len(l)-1] }, "incomplete record"},
		{"zeroes", func(l []byte) []byte { return make([]byte, len(l)) }, "incomplete record"},
		{"zeroes and newline", func(l []byte) []byte { return append(make([]byte, len(l)-1), '\n') }, "not a journal record"},
		{"byte flipped", func(l []byte) []byte { l[20] ^= 1; return l }, "checksum mismatch (record torn or modified)"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := loaded(t)
			add(t, s, sampleA()...)
			s.Close()
			lines := journalLines(t, s)
			good := strings.Join(lines[:2], "")
			writeFile(t, s.JournalPath(), good+string(tt.tear([]byte(lines[2]))))

			eps, rep := reopen(t, s)
			sameEndpoints(t, eps, sampleA()[:2])
			all := strings.Join(rep.Problems, "\n")
			if rep.Replayed != 2 || len(rep.Problems) != 1 || !strings.Contains(all, s.JournalPath()+" line 3: "+tt.want) ||
				!strings.Contains(all, "never acknowledged") {
				t.Errorf("report %+v, want 2 replayed and the torn line 3 reported as %q", rep, tt.want)
			}
			if data, _ := os.ReadFile(s.JournalPath()); string(data) != good {
				t.Errorf("torn line not cut off: %q", data)
			}
			t.Log(all)

			// A new store appends after the good lines; the next start is clean.
			s2, _ := NewStore(filepath.Dir(s.Path()))
			load(t, s2)
			add(t, s2, sampleA()[2])
			s2.Close()
			eps, rep = reopen(t, s)
			sameEndpoints(t, eps, sampleA())
			if len(rep.Problems) != 0 {
				t.Errorf("after the torn line was cut: problems %v", rep.Problems)
			}
		})
	}
}

// A bad line with good lines after it is damage, not a crash: the records
// after it may depend on it. Load refuses, names the line, changes nothing.
func TestJournalCorruptMiddleLine(t *testing.T) {
	for _, tt := range []struct {
		name    string
		corrupt func(lines []string) []string
		want    string
	}{
		{"byte flipped", func(l []string) []string { l[1] = strings.Replace(l[1], "fd00::2", "fd00::3", 1); return l },
			"line 2: checksum mismatch (record torn or modified); the"},
		{"torn then written on", func(l []string) []string { l[1] = l[1][:30] + "\n"; return l }, "line 2: checksum mismatch"},
		{"line missing", func(l []string) []string { return slices.Delete(l, 1, 2) }, "line 2: record 3 follows record 1; records are missing"},
		{"lines swapped", func(l []string) []string { l[1], l[2] = l[2], l[1]; return l }, "line 2: record 3 follows record 1"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := loaded(t)
			add(t, s, sampleA()...)
			s.Close()
			bad := strings.Join(tt.corrupt(journalLines(t, s)), "")
			writeFile(t, s.JournalPath(), bad)
			before := dirNames(t, s)

			s2, _ := NewStore(filepath.Dir(s.Path()))
			eps, _, err := s2.Load()
			if err == nil || !strings.Contains(err.Error(), s.JournalPath()+" "+tt.want) {
				t.Fatalf("Load = %v, %v; want an error saying %q", eps, err, s.JournalPath()+" "+tt.want)
			}
			if after := dirNames(t, s); !slices.Equal(before, after) {
				t.Errorf("Load changed the directory from %v to %v", before, after)
			}
			if data, _ := os.ReadFile(s.JournalPath()); string(data) != bad {
				t.Errorf("Load changed the journal")
			}
			if err := s2.Add(ep("10.244.1.8", "x", 0, t0)); err == nil {
				t.Errorf("Add after a failed Load succeeded")
			}
			t.Log(err)
		})
	}
}

// Records that pass their checksums but do not apply (written by hand, or
// by a bug) fail Load with the snapshot's own checks.
func TestJournalReplayInvalid(t *testing.T) {
	s := newStore(t)
	var buf bytes.Buffer
	for i, rec := range []journalRecord{
		{Op: "add", Endpoint: ep("10.244.1.2", "a", 0, t0)},
		{Op: "add", Endpoint: ep("10.244.1.3", "a", 0, t0)},
	} {
		rec.Seq = uint64(i + 1)
		line, err := encodeRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		buf.Write(line)
	}
	writeFile(t, s.JournalPath(), buf.String())
	_, _, err := s.Load()
	want := `replaying 2 record(s) onto the snapshot (none) gives an invalid state: owner "a" holds two ipv4 addresses`
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Load: %v, want %q", err, want)
	}
}

// A journal that starts after the snapshot ends lost records in between.
func TestJournalGapAfterSnapshot(t *testing.T) {
	s := loaded(t)
	save(t, s, sampleA())                   // journalSeq 0
	add(t, s, ep("10.244.1.8", "x", 0, t0)) // record 1
	add(t, s, ep("10.244.1.9", "y", 0, t0)) // record 2
	s.Close()
	writeFile(t, s.JournalPath(), journalLines(t, s)[1])
	s2, _ := NewStore(filepath.Dir(s.Path()))
	_, _, err := s2.Load()
	want := s.JournalPath() + " line 1: starts at record 2 but the snapshot (file) includes records up to 0 only: records 1 to 1 are missing"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Load: %v, want %q", err, want)
	}
}

// When the snapshot is bad, the backup is older than the journal's start:
// the records in between are lost with the bad file. Load says which, and
// still applies the journal, whose records are newer than both.
func TestJournalOntoBackup(t *testing.T) {
	s := loaded(t)
	add(t, s, sampleA()...)
	if err := s.Compact(); err != nil { // snapshot: records 1..3
		t.Fatal(err)
	}
	add(t, s, ep("10.244.1.8", "x", 0, t0)) // record 4
	if err := s.Compact(); err != nil {     // snapshot: 1..4, backup 1..3
		t.Fatal(err)
	}
	add(t, s, ep("10.244.1.9", "y", 0, t0)) // record 5
	s.Close()
	writeFile(t, s.Path(), "garbage")

	eps, rep := reopen(t, s)
	sameEndpoints(t, eps, append(sampleA(), ep("10.244.1.9", "y", 0, t0)))
	all := strings.Join(rep.Problems, "\n")
	if rep.Origin != "backup" || rep.Replayed != 1 || !strings.Contains(all, "records 4 to 4 were only in the bad snapshot and are lost") {
		t.Errorf("report %+v, want Source backup, 1 replayed, records 4 to 4 lost", rep)
	}
}

func TestCompactionThreshold(t *testing.T) {
	s := loaded(t)
	s.compactRecords = 4
	save(t, s, sampleA()[:1])
	add(t, s, sampleA()[1:]...)
	add(t, s, ep("10.244.1.8", "x", 0, t0))
	del(t, s, "10.244.1.8")
	if s.NeedsCompaction() {
		t.Fatal("NeedsCompaction with 4 records, threshold 4")
	}
	add(t, s, ep("10.244.1.9", "y", 0, t0))
	if !s.NeedsCompaction() {
		t.Fatal("no NeedsCompaction with 5 records, threshold 4")
	}
	if err := s.Compact(); err != nil {
		t.Fatal(err)
	}
	want := append(sampleA(), ep("10.244.1.9", "y", 0, t0))
	if s.NeedsCompaction() || len(journalLines(t, s)) != 0 {
		t.Errorf("after Compact: NeedsCompaction %v, journal %q", s.NeedsCompaction(), journalLines(t, s))
	}
	if seq := snapshotSeq(t, s.Path()); seq != 5 {
		t.Errorf("snapshot journalSeq %d, want 5", seq)
	}
	if bak, _, err := readState(s.Path() + ".bak"); err != nil {
		t.Errorf("backup: %v", err)
	} else {
		sameEndpoints(t, bak, sampleA()[:1])
	}
	// Numbering goes on after the snapshot's.
	add(t, s, ep("10.244.1.10", "z", 0, t0))
	if l := journalLines(t, s); len(l) != 1 || !strings.Contains(l[0], `"seq":6`) {
		t.Errorf("journal after compaction %q, want record 6", l)
	}
	eps, rep := reopen(t, s)
	sameEndpoints(t, eps, append(want, ep("10.244.1.10", "z", 0, t0)))
	if rep.Origin != "file" || rep.Replayed != 1 {
		t.Errorf("report %+v", rep)
	}

	// A large journal counts too.
	s.compactBytes = 100
	if !s.NeedsCompaction() {
		t.Error("no NeedsCompaction with the journal over compactBytes")
	}
}

// crashStates are the directory contents a crash can leave during a
// compaction, from before it starts to after it ends. Each must load as
// the same state: nothing lost, nothing applied twice.
func TestCompactionCrashStates(t *testing.T) {
	// History: records that would go wrong if replayed twice onto a
	// snapshot that includes them (the owner "x" moves from .8 to .9,
	// then .8 goes to "y"), and two appended during the compaction.
	s := loaded(t)
	save(t, s, sampleA())
	old := readBytes(t, s.Path())
	add(t, s, ep("10.244.1.8", "x", 0, t0)) // 1
	del(t, s, "10.244.1.8")                 // 2
	add(t, s, ep("10.244.1.9", "x", 0, t0)) // 3
	add(t, s, ep("10.244.1.8", "y", 0, t0)) // 4
	full := readBytes(t, s.JournalPath())
	snapEps, snapSeq := s.sortedLocked(), s.seq
	add(t, s, ep("fd00::8", "y", 0, t0)) // 5, during the snapshot write
	del(t, s, "10.244.1.3")              // 6
	fullPlus := readBytes(t, s.JournalPath())
	tail := fullPlus[len(full):]
	want := s.sortedLocked()
	wantBefore := snapEps

	newSnap, err := encodeState(snapEps, snapSeq)
	if err != nil {
		t.Fatal(err)
	}
	type files map[string][]byte
	for _, tt := range []struct {
		name  string
		files files
		want  []*tables.Endpoint
	}{
		{"before", files{"endpoints.json": old, "endpoints.journal": full}, wantBefore},
		{"snapshot in .tmp", files{"endpoints.json": old, "endpoints.json.tmp": newSnap, "endpoints.journal": full}, wantBefore},
		{"backup linked", files{"endpoints.json": old, "endpoints.json.bak": old, "endpoints.json.tmp": newSnap, "endpoints.journal": full}, wantBefore},
		{"snapshot renamed, journal whole", files{"endpoints.json": newSnap, "endpoints.json.bak": old, "endpoints.journal": full}, wantBefore},
		{"journal truncated", files{"endpoints.json": newSnap, "endpoints.json.bak": old, "endpoints.journal": nil}, wantBefore},
		{"appends during snapshot, journal whole", files{"endpoints.json": newSnap, "endpoints.json.bak": old, "endpoints.journal": fullPlus}, want},
		{"appends during snapshot, tail in .tmp", files{"endpoints.json": newSnap, "endpoints.json.bak": old, "endpoints.journal": fullPlus, "endpoints.journal.tmp": tail}, want},
		{"appends during snapshot, journal replaced", files{"endpoints.json": newSnap, "endpoints.json.bak": old, "endpoints.journal": tail}, want},
		{"before, with appends", files{"endpoints.json": old, "endpoints.journal": fullPlus}, want},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			for name, data := range tt.files {
				writeFile(t, filepath.Join(dir, name), string(data))
			}
			s2, _ := NewStore(dir)
			defer s2.Close()
			eps, rep, err := s2.Load()
			if err != nil {
				t.Fatalf("Load: %v", err)
			}
			sameEndpoints(t, eps, tt.want)
			if len(rep.Problems) != 0 || rep.Origin != "file" {
				t.Errorf("report %+v, want Source file, no problems", rep)
			}
			// The compaction at start finishes the job.
			if err := s2.Compact(); err != nil {
				t.Fatal(err)
			}
			s3, _ := NewStore(dir)
			defer s3.Close()
			eps, rep = load(t, s3)
			sameEndpoints(t, eps, tt.want)
			if rep.Replayed != 0 {
				t.Errorf("after compaction %d records replayed", rep.Replayed)
			}
		})
	}

	// The real thing, with the journal replaced: the appends made during
	// the snapshot survive it.
	s.compactRecords = 0
	if err := s.Compact(); err != nil {
		t.Fatal(err)
	}
	eps, _ := reopen(t, s)
	sameEndpoints(t, eps, want)
}

func readBytes(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// Save replaces everything: the journal's records are superseded, also
// when a crash leaves them next to the new snapshot, and also when the
// store was not loaded.
func TestSaveSupersedesJournal(t *testing.T) {
	s := loaded(t)
	add(t, s, sampleB()...)
	full := readBytes(t, s.JournalPath())
	save(t, s, sampleA()[:1])
	if l := journalLines(t, s); len(l) != 0 {
		t.Errorf("journal after Save: %q", l)
	}
	writeFile(t, s.JournalPath(), string(full)) // crash before the journal was emptied
	eps, rep := reopen(t, s)
	sameEndpoints(t, eps, sampleA()[:1])
	if rep.Replayed != 0 {
		t.Errorf("replayed %d superseded records", rep.Replayed)
	}

	// Not loaded: Save reads the journal's last record number.
	s2, _ := NewStore(filepath.Dir(s.Path()))
	defer s2.Close()
	writeFile(t, s.JournalPath(), string(full))
	save(t, s2, sampleA()[1:2])
	if seq := snapshotSeq(t, s.Path()); seq != 4 {
		t.Errorf("Save without Load: journalSeq %d, want 4", seq)
	}
	eps, _ = reopen(t, s)
	sameEndpoints(t, eps, sampleA()[1:2])
}

// A journal removed or replaced under a running store would swallow the
// appends: the next change writes a snapshot and starts a new journal.
func TestJournalRemovedUnderStore(t *testing.T) {
	for _, how := range []string{"removed", "replaced"} {
		t.Run(how, func(t *testing.T) {
			s := loaded(t)
			add(t, s, sampleA()...)
			os.Remove(s.JournalPath())
			if how == "replaced" {
				writeFile(t, s.JournalPath(), "")
			}
			add(t, s, ep("10.244.1.8", "x", 0, t0))
			eps, rep := reopen(t, s)
			sameEndpoints(t, eps, append(sampleA(), ep("10.244.1.8", "x", 0, t0)))
			if rep.Origin != "file" || rep.Replayed != 1 {
				t.Errorf("report %+v, want the snapshot and 1 record", rep)
			}
		})
	}
}

// Changes and compactions at once: every acknowledged change is on disk.
func TestJournalConcurrentWithCompaction(t *testing.T) {
	s := loaded(t)
	s.compactRecords = 8
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if s.NeedsCompaction() {
				if err := s.Compact(); err != nil {
					t.Error(err)
				}
			}
			time.Sleep(time.Millisecond)
		}
	})
	var adders sync.WaitGroup
	for w := range 4 {
		adders.Go(func() {
			for i := range 25 {
				ip := netip.AddrFrom4([4]byte{10, 244, byte(w), byte(i + 1)})
				if err := s.Add(ep(ip.String(), fmt.Sprintf("w%d-%d", w, i), 0, t0)); err != nil {
					t.Error(err)
				}
				if i%3 == 0 {
					if err := s.Delete(ip); err != nil {
						t.Error(err)
					}
				}
			}
		})
	}
	adders.Wait()
	close(stop)
	wg.Wait()
	want := s.sortedLocked()
	if len(want) != 4*(25-9) {
		t.Fatalf("store holds %d endpoints, want %d", len(want), 4*(25-9))
	}
	eps, _ := reopen(t, s)
	sameEndpoints(t, eps, want)
}
