package ipam

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"syscall"

	"github.com/ipmasq/ipmasq/tables"
)

// The journal, <dir>/endpoints.journal, holds the changes made since the
// snapshot, one line per change, appended and fdatasynced before the change
// is acknowledged:
//
//	1c2a3b4d {"seq":7,"op":"add","endpoint":{"ip":"10.244.1.7","owner":"ctr/eth0",...}}
//	0e9f8a7b {"seq":8,"op":"del","ip":"10.244.1.3"}
//
// The first field is the CRC-32C (Castagnoli) of the JSON after the space,
// in hex, so a torn or damaged line is recognised. seq numbers the records
// 1, 2, 3, ... without gaps, across compactions: a snapshot says which
// record it includes last (journalSeq), and Load applies only the records
// after it. Replaying is therefore exact, never "at least once", and a gap
// between the snapshot and the journal is seen, not guessed at.
//
// Each change is one line written by one write and synced before the next
// one starts, so only the last line can be the victim of a crash.

// A compaction is due after defaultCompactRecords records or
// defaultCompactBytes bytes (256 bytes a record), raised for large states
// (compactionThresholdsLocked). A compaction cuts the journal under the
// lock that every change takes, and cutting it while changes go on
// (renaming a new journal into place, two fsyncs) made the change waiting
// behind it 0.3-0.6 ms slower: with a threshold of 256 records, a node
// allocating and releasing in a loop compacted every 128 allocations, and
// 1 to 7 of the 10 slowest of 1 000 allocations over the API (the p99)
// waited for a compaction. At 2 048 records a restart replays
// at most ~2 048 journal lines (~280 KB, a few ms) at any state size up to
// 4 096 endpoints, and the same as before above it.
const (
	defaultCompactRecords = 2048
	defaultCompactBytes   = defaultCompactRecords * 256
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// journalRecord is one change.
type journalRecord struct {
	Seq      uint64           `json:"seq"`
	Op       string           `json:"op"` // "add" or "del"
	Endpoint *tables.Endpoint `json:"endpoint,omitzero"`
	IP       netip.Addr       `json:"ip,omitzero"`
}

// journalLine is a record as it is in the file, newline included.
type journalLine struct {
	seq  uint64
	data []byte
}

func encodeRecord(rec journalRecord) ([]byte, error) {
	js, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	line := make([]byte, 0, len(js)+10)
	line = fmt.Appendf(line, "%08x ", crc32.Checksum(js, castagnoli))
	line = append(line, js...)
	return append(line, '\n'), nil
}

// decodeRecord checks one line, without its newline.
func decodeRecord(line []byte) (journalRecord, error) {
	var rec journalRecord
	if len(line) < 10 || line[8] != ' ' {
		return rec, errors.New("not a journal record (want <crc32c> <json>)")
	}
	want, err := hex.DecodeString(string(line[:8]))
	js := line[9:]
	sum := crc32.Checksum(js, castagnoli)
	if err != nil || !bytes.Equal(want, []byte{byte(sum >> 24), byte(sum >> 16), byte(sum >> 8), byte(sum)}) {
		return rec, errors.New("checksum mismatch (record torn or modified)")
	}
	if err := json.Unmarshal(js, &rec); err != nil {
		return rec, fmt.Errorf("invalid record: %w", err)
	}
	switch {
	case rec.Seq == 0:
		return rec, errors.New("record has no seq")
	case rec.Op == "add" && rec.Endpoint == nil:
		return rec, errors.New(`"add" record has no endpoint`)
	case rec.Op == "add":
		if err := validateEndpoints([]*tables.Endpoint{rec.Endpoint}); err != nil {
			return rec, err
		}
	case rec.Op == "del" && !rec.IP.IsValid():
		return rec, errors.New(`"del" record has no valid ip`)
	case rec.Op != "del":
		return rec, fmt.Errorf("unknown op %q (want add or del)", rec.Op)
	}
	return rec, nil
}

// journal is the journal file as Load read it.
type journal struct {
	name    string
	lines   []journalLine
	records []journalRecord
	// size is the length of the good lines: where a torn last line, if
	// any, is cut off.
	size int64
	// torn is the problem report for a dropped last line, or "".
	torn string
}

func (j *journal) lastSeq() uint64 {
	if len(j.lines) == 0 {
		return 0
	}
	return j.lines[len(j.lines)-1].seq
}

// readJournal reads and checks the journal; it changes nothing on disk. A
// missing journal is an empty one.
func readJournal(name string) (*journal, error) {
	j := &journal{name: name}
	data, err := os.ReadFile(name)
	if errors.Is(err, fs.ErrNotExist) {
		return j, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%s: unreadable: %w", name, err)
	}
	for off, n := 0, 1; off < len(data); n++ {
		end := bytes.IndexByte(data[off:], '\n')
		var rec journalRecord
		if end < 0 {
			err = errors.New("incomplete record (no end of line)")
			end = len(data) - off
		} else {
			rec, err = decodeRecord(data[off : off+end])
			if err == nil && len(j.records) > 0 && rec.Seq != j.lastSeq()+1 {
				return nil, fmt.Errorf("%s line %d: record %d follows record %d; records are missing or out of order, refusing to guess which changes happened",
					name, n, rec.Seq, j.lastSeq())
			}
		}
		if err != nil {
			if off+end+1 < len(data) {
				return nil, fmt.Errorf("%s line %d: %v; the %d byte(s) after it were written later and cannot be trusted to apply without it, refusing to guess which changes happened (inspect the file; removing this line and those after it forgets those changes)",
					name, n, err, len(data)-off-end-1)
			}
			j.torn = fmt.Sprintf("%s line %d: %v; dropped this last record (%d bytes: %s): it was being written when the agent stopped and was never acknowledged",
				name, n, err, len(data)-off, quotePrefix(data[off:], 80))
			break
		}
		j.lines = append(j.lines, journalLine{seq: rec.Seq, data: data[off : off+end+1]})
		j.records = append(j.records, rec)
		off += end + 1
		j.size = int64(off)
	}
	return j, nil
}

func quotePrefix(b []byte, n int) string {
	if len(b) > n {
		return strconv.Quote(string(b[:n])) + "..."
	}
	return strconv.Quote(string(b))
}

// replay applies the records after seq to base, the snapshot from source.
// Problems are what Load reports; an error means the journal does not
// apply to the snapshot.
func (j *journal) replay(base []*tables.Endpoint, seq uint64, source string) ([]*tables.Endpoint, int, []string, error) {
	var problems []string
	byIP := make(map[netip.Addr]*tables.Endpoint, len(base))
	for _, ep := range base {
		byIP[ep.IP] = ep
	}
	applied := 0
	for i, rec := range j.records {
		if rec.Seq <= seq {
			continue // in the snapshot already
		}
		if applied == 0 && rec.Seq != seq+1 {
			missing := fmt.Sprintf("records %d to %d", seq+1, rec.Seq-1)
			if source != "backup" {
				return nil, 0, nil, fmt.Errorf("%s line %d: starts at record %d but the snapshot (%s) includes records up to %d only: %s are missing, refusing to guess which changes happened",
					j.name, i+1, rec.Seq, source, seq, missing)
			}
			problems = append(problems, fmt.Sprintf("%s: %s were only in the bad snapshot and are lost", j.name, missing))
		}
		switch rec.Op {
		case "add":
			byIP[rec.Endpoint.IP] = rec.Endpoint
		case "del":
			delete(byIP, rec.IP)
		}
		applied++
	}
	eps := make([]*tables.Endpoint, 0, len(byIP))
	for _, ep := range byIP {
		eps = append(eps, ep)
	}
	slices.SortFunc(eps, func(a, b *tables.Endpoint) int { return a.IP.Compare(b.IP) })
	if err := validateEndpoints(eps); err != nil {
		return nil, 0, nil, fmt.Errorf("%s: replaying %d record(s) onto the snapshot (%s) gives an invalid state: %w", j.name, applied, source, err)
	}
	return eps, applied, problems, nil
}

// lastJournalSeq is the last good record number in a journal that was not
// loaded, for a Save that must supersede it; 0 if there is none.
func lastJournalSeq(name string) uint64 {
	data, err := os.ReadFile(name)
	if err != nil {
		return 0
	}
	var last uint64
	for line := range bytes.Lines(data) {
		if rec, err := decodeRecord(bytes.TrimSuffix(line, []byte("\n"))); err == nil {
			last = max(last, rec.Seq)
		}
	}
	return last
}

// Add records a new endpoint durably: when it returns nil, the endpoint
// survives a crash. The address must be free and the owner must hold no
// address of the family: Add refuses what Load would refuse.
func (s *Store) Add(ep *tables.Endpoint) error {
	return s.append(func() (journalRecord, error) {
		if err := validateEndpoints([]*tables.Endpoint{ep}); err != nil {
			return journalRecord{}, err
		}
		if other, ok := s.eps[ep.IP]; ok {
			return journalRecord{}, fmt.Errorf("ip %s is already allocated to %q", ep.IP, other.Owner)
		}
		if other, ok := s.owners[ownerFamily{ep.Owner, ep.Family()}]; ok {
			return journalRecord{}, fmt.Errorf("owner %q already holds the %s address %s", ep.Owner, ep.Family(), other)
		}
		return journalRecord{Op: "add", Endpoint: ep}, nil
	})
}

// Delete records the release of an allocated address durably: when it
// returns nil, the release survives a crash.
func (s *Store) Delete(ip netip.Addr) error {
	return s.append(func() (journalRecord, error) {
		if _, ok := s.eps[ip]; !ok {
			return journalRecord{}, fmt.Errorf("ip %s is not allocated", ip)
		}
		return journalRecord{Op: "del", IP: ip}, nil
	})
}

// append writes the record that build makes from the current state, then
// applies it. On any error nothing is applied, and the journal is as it
// was, or closed so that the next change starts a new one.
func (s *Store) append(build func() (journalRecord, error)) error {
	s.mu.Lock()
	if s.loaded && !s.closed && !s.journalInPlace() {
		// Starting a new journal writes a snapshot: that needs fileMu,
		// which is taken first.
		s.mu.Unlock()
		s.fileMu.Lock()
		defer s.fileMu.Unlock()
		s.mu.Lock()
	}
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return fmt.Errorf("%s: store closed", s.journal)
	case !s.loaded:
		return fmt.Errorf("%s: change before the state was loaded", s.journal)
	}
	rec, err := build()
	if err != nil {
		return fmt.Errorf("refusing to journal the change to %s: %w", s.journal, err)
	}
	if !s.journalInPlace() {
		if err := s.resetLocked(); err != nil {
			return err
		}
	}
	rec.Seq = s.seq + 1
	line, err := encodeRecord(rec)
	if err != nil {
		return fmt.Errorf("encode journal record: %w", err)
	}
	_, err = s.jf.Write(line)
	if err == nil {
		err = fdatasync(s.jf)
	}
	if err != nil {
		// A partial line would make every later line unreadable.
		if terr := s.jf.Truncate(s.size); terr != nil {
			s.closeJournal()
		}
		return fmt.Errorf("append to %s: %w", s.journal, err)
	}
	s.seq = rec.Seq
	s.records++
	s.size += int64(len(line))
	if s.compacting {
		s.tail = append(s.tail, journalLine{seq: rec.Seq, data: line})
	}
	switch rec.Op {
	case "add":
		s.eps[rec.Endpoint.IP] = rec.Endpoint
		s.owners[ownerFamily{rec.Endpoint.Owner, rec.Endpoint.Family()}] = rec.Endpoint.IP
	case "del":
		ep := s.eps[rec.IP]
		delete(s.eps, rec.IP)
		delete(s.owners, ownerFamily{ep.Owner, ep.Family()})
	}
	return nil
}

func fdatasync(f *os.File) error {
	for {
		err := syscall.Fdatasync(int(f.Fd()))
		if err != syscall.EINTR {
			return err
		}
	}
}

// journalInPlace says whether the open journal is still the file at its
// name: appends to a journal that was removed or replaced would be lost.
func (s *Store) journalInPlace() bool {
	if s.jf == nil {
		return false
	}
	fi, err := os.Stat(s.journal)
	return err == nil && os.SameFile(fi, s.jfi)
}

// resetLocked starts over after the journal was lost, replaced or left in
// an unknown state: a snapshot of the state, then an empty journal. The
// caller holds fileMu and mu.
func (s *Store) resetLocked() error {
	s.closeJournal()
	if err := s.writeSnapshot(s.sortedLocked(), s.seq); err != nil {
		return fmt.Errorf("journal %s is missing or unusable, and a new snapshot cannot be written: %w", s.journal, err)
	}
	if err := s.replaceJournalLocked(nil); err != nil {
		return fmt.Errorf("start a new journal %s: %w", s.journal, err)
	}
	return nil
}

// replaceJournalLocked atomically replaces the journal with the lines and
// opens it. On error the journal is closed.
func (s *Store) replaceJournalLocked(lines []journalLine) error {
	s.closeJournal()
	var buf bytes.Buffer
	for _, l := range lines {
		buf.Write(l.data)
	}
	tmp := s.journal + ".tmp"
	if err := writeFileSync(tmp, buf.Bytes()); err != nil {
		return err
	}
	if err := os.Rename(tmp, s.journal); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("replace journal: %w", err)
	}
	s.records, s.size = len(lines), int64(buf.Len())
	return s.openJournalLocked()
}

// openJournalLocked opens the journal for appending, creating it if
// needed; it must hold s.size bytes.
func (s *Store) openJournalLocked() error {
	f, err := os.OpenFile(s.journal, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("open journal: %w", err)
	}
	fi, err := f.Stat()
	if err == nil && fi.Size() != s.size {
		err = fmt.Errorf("has %d bytes, expected %d; changed by another process?", fi.Size(), s.size)
	}
	if err == nil {
		// Its name may be new; the records in it must not vanish with it.
		err = syncDir(s.dir)
	}
	if err != nil {
		f.Close()
		return fmt.Errorf("open journal %s: %w", s.journal, err)
	}
	s.jf, s.jfi = f, fi
	return nil
}

func (s *Store) closeJournal() {
	if s.jf != nil {
		s.jf.Close()
		s.jf, s.jfi = nil, nil
	}
}

func (s *Store) sortedLocked() []*tables.Endpoint {
	eps := make([]*tables.Endpoint, 0, len(s.eps))
	for _, ep := range s.eps {
		eps = append(eps, ep)
	}
	slices.SortFunc(eps, func(a, b *tables.Endpoint) int { return a.IP.Compare(b.IP) })
	return eps
}

// NeedsCompaction says whether the journal has grown past the point where
// Compact should run.
func (s *Store) NeedsCompaction() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	records, bytes := s.compactionThresholdsLocked()
	return s.loaded && !s.closed && (s.records > records || s.size > bytes)
}

// compactionThresholdsLocked are compactRecords and compactBytes, raised in
// proportion once the state holds more than twice compactRecords
// endpoints: a compaction encodes and writes every endpoint, so with n
// endpoints it is due after n/2 records at the earliest, and its cost per
// change stays the same whatever n. With fixed thresholds, 10 000
// endpoints were written out every ~250 changes, and allocations waited
// for the CPU each snapshot took and for the journal's cut: in 600 traced
// allocations, 9–10 compactions, 17–32 % of the allocations and 14 of the
// 18 slowest overlapped one. The journal then holds at most
// about half the state's records, which a restart replays.
func (s *Store) compactionThresholdsLocked() (records int, bytes int64) {
	records, bytes = s.compactRecords, s.compactBytes
	if half := len(s.eps) / 2; records > 0 && half > records {
		bytes = bytes * int64(half) / int64(records)
		records = half
	}
	return records, bytes
}

// Compact writes a snapshot of the state and removes the records it
// includes from the journal. Add and Delete proceed while the snapshot is
// written; they wait only for the journal to be cut.
//
// Crash safety rests on record numbers, not on the order of the files
// alone: the snapshot says the last record it includes, so until the
// journal is cut, Load skips the records that are in both. At every
// instant the disk holds one of
//   - the old snapshot (or, mid-rename, the old one as .bak) and the whole
//     journal: Load replays every record after the old snapshot's;
//   - the new snapshot and the whole journal: Load skips records up to
//     the new snapshot's, replays the later ones;
//   - the new snapshot and the cut journal: the records after the new
//     snapshot's, if any were appended meanwhile.
//
// The journal is cut by truncation when nothing was appended during the
// snapshot, else replaced by rename with the records appended since: both
// are atomic, and both leave a journal that applies to the new snapshot.
// Nothing is lost, nothing is applied twice.
func (s *Store) Compact() error {
	s.fileMu.Lock()
	defer s.fileMu.Unlock()
	s.mu.Lock()
	if s.closed || !s.loaded {
		s.mu.Unlock()
		return fmt.Errorf("compact %s: store not loaded or closed", s.journal)
	}
	eps, seq := s.sortedLocked(), s.seq
	s.compacting, s.tail = true, nil
	s.mu.Unlock()

	err := s.writeSnapshot(eps, seq)
	s.mu.Lock()
	defer s.mu.Unlock()
	tail := s.tail
	s.compacting, s.tail = false, nil
	if err != nil {
		return fmt.Errorf("compact %s: %w", s.journal, err)
	}
	if !s.journalInPlace() {
		return nil // the next change starts a new journal
	}
	if len(tail) > 0 {
		if err := s.replaceJournalLocked(tail); err != nil {
			return fmt.Errorf("compact %s: %w", s.journal, err)
		}
		return nil
	}
	err = s.jf.Truncate(0)
	if err == nil {
		err = fdatasync(s.jf)
	}
	if err != nil {
		// The journal holds records the snapshot includes, or nothing:
		// either is correct, but its length is unknown.
		s.closeJournal()
		return fmt.Errorf("compact %s: truncate: %w", s.journal, err)
	}
	s.records, s.size = 0, 0
	return nil
}

// Close closes the journal, after a Compact in progress. Later changes
// fail; Load opens the store again.
func (s *Store) Close() error {
	s.fileMu.Lock()
	defer s.fileMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.jf == nil {
		return nil
	}
	err := s.jf.Close()
	s.jf, s.jfi = nil, nil
	return err
}

// truncateSync cuts a file to size durably.
func truncateSync(name string, size int64) error {
	f, err := os.OpenFile(name, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
