package ipam

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

const (
	stateFile   = "endpoints.json"
	journalFile = "endpoints.journal"
	// stateVersion 2 adds journalSeq: a version-1 ipmasq would ignore the
	// journal and forget the allocations in it, so it must refuse the file.
	stateVersion = 2
)

// Store keeps the endpoints in <dir>/endpoints.json (the snapshot), the
// previous good snapshot in <dir>/endpoints.json.bak, and every change made
// since the snapshot in <dir>/endpoints.journal, so that a crash or a
// corrupt file never loses allocations silently. A change costs one
// appended line and one fdatasync; the snapshot is rewritten only when the
// journal has grown (see Compact).
//
// Other names in dir: <name>.tmp is a write in progress (ignored by Load,
// overwritten by the next write); <file>.corrupt-<unix-seconds> is a bad
// snapshot that Load put aside for inspection (never read again, never
// removed).
//
// The store keeps its own copy of the endpoints, as Load, Save, Add and
// Delete left them, so that it can check changes and compact without asking
// the caller.
type Store struct {
	dir, file, bak, journal string

	// Compaction is due when the journal holds more than compactRecords
	// records or compactBytes bytes.
	compactRecords int
	compactBytes   int64

	// fileMu serializes the writers of the snapshot (Load, Save, Compact,
	// and an Add or Delete that must start a new journal): they share the
	// .tmp names. Taken before mu, never while holding it.
	fileMu sync.Mutex
	// mu guards the fields below; an Add or Delete holds it only for its
	// append, not for a snapshot being written by Compact.
	mu     sync.Mutex
	loaded bool // Load or Save has set eps and seq
	closed bool
	eps    map[netip.Addr]*tables.Endpoint
	owners map[ownerFamily]netip.Addr
	// seq is the number of the last record written to the journal, or
	// included in the snapshot if that is later.
	seq uint64
	// jf is the open journal, appended to; nil when a new one must be
	// started (see resetLocked). jfi identifies its inode.
	jf  *os.File
	jfi os.FileInfo
	// records counts the records in the journal, size its length in
	// bytes.
	records int
	size    int64
	// While a compaction writes its snapshot, tail collects the records
	// appended meanwhile: they go into the journal that replaces the cut
	// one. Otherwise no record is kept in memory (with thresholds that grow
	// with the state, the journal can hold thousands).
	compacting bool
	tail       []journalLine
}

type ownerFamily struct {
	owner  string
	family tables.Family
}

// NewStore creates dir (mode 0700) if needed.
func NewStore(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create IPAM state directory: %w", err)
	}
	file := filepath.Join(dir, stateFile)
	return &Store{
		dir: dir, file: file, bak: file + ".bak", journal: filepath.Join(dir, journalFile),
		compactRecords: defaultCompactRecords, compactBytes: defaultCompactBytes,
	}, nil
}

// Path is the snapshot, <dir>/endpoints.json.
func (s *Store) Path() string { return s.file }

// JournalPath is the journal, <dir>/endpoints.journal.
func (s *Store) JournalPath() string { return s.journal }

// stateHeader is the part of the file read before the endpoints are
// trusted: the version says how to read the rest, the checksum whether
// the endpoints array is what was written.
//
// Version 2 adds journalSeq, the last journal record the snapshot includes;
// its checksum covers "<journalSeq>:<endpoints>" so that a damaged number
// cannot make Load skip or repeat records. Version 1 has no journal: its
// checksum covers the endpoints alone.
type stateHeader struct {
	Version    *int            `json:"version"`
	JournalSeq *uint64         `json:"journalSeq"`
	Endpoints  json.RawMessage `json:"endpoints"`
	SHA256     *string         `json:"sha256"`
}

func stateChecksum(version int, seq uint64, endpoints []byte) [sha256.Size]byte {
	if version == 1 {
		return sha256.Sum256(endpoints)
	}
	h := sha256.New()
	h.Write([]byte(strconv.FormatUint(seq, 10) + ":"))
	h.Write(endpoints)
	return [sha256.Size]byte(h.Sum(nil))
}

// Save replaces the whole state: it writes a snapshot of eps and starts
// an empty journal. The endpoints are written sorted by IP; they must pass
// the same checks as Load makes, so that a save never produces a file the
// next start refuses. Add and Delete are the cheap way to record a change;
// Save is for setting the state wholesale.
//
// The snapshot says it includes every journal record written so far, so a
// crash after it is in place but before the journal is emptied replays
// nothing twice.
func (s *Store) Save(eps []*tables.Endpoint) error {
	s.fileMu.Lock()
	defer s.fileMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()

	sorted := slices.Clone(eps)
	slices.SortFunc(sorted, func(a, b *tables.Endpoint) int { return a.IP.Compare(b.IP) })
	if err := validateEndpoints(sorted); err != nil {
		return fmt.Errorf("refusing to save %s: %w", s.file, err)
	}
	seq := s.seq
	if !s.loaded {
		// Records a Load has not seen must still count as included.
		seq = max(seq, lastJournalSeq(s.journal))
	}
	if err := s.writeSnapshot(sorted, seq); err != nil {
		return err
	}
	s.setState(sorted, seq)
	if err := s.replaceJournalLocked(nil); err != nil {
		// The snapshot holds everything and says so: the old journal's
		// records will be skipped. The next change starts a new journal.
		s.closeJournal()
	}
	return nil
}

// writeSnapshot replaces the snapshot atomically and durably; eps are
// sorted and valid. The caller holds fileMu.
//
// The steps keep a complete, fsynced file under <file> or <file>.bak at
// every instant: write <file>.tmp and fsync it; hard-link the current file
// to <bak>.tmp and rename that over <bak> (the backup is never missing,
// and is the file as it was, not a copy that could be torn); rename
// <file>.tmp over <file>; fsync the directory. The directory is synced
// once, at the end: every name points at an fsynced inode throughout, so
// whichever renames a crash loses, each name still holds a good file.
func (s *Store) writeSnapshot(sorted []*tables.Endpoint, seq uint64) error {
	data, err := encodeState(sorted, seq)
	if err != nil {
		return fmt.Errorf("encode %s: %w", s.file, err)
	}
	tmp := s.file + ".tmp"
	if err := writeFileSync(tmp, data); err != nil {
		return err
	}
	if err := s.linkBackup(); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, s.file); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("save endpoints: %w", err)
	}
	if err := syncDir(s.dir); err != nil {
		return fmt.Errorf("save endpoints: %w", err)
	}
	return nil
}

// linkBackup makes the current file the backup. With no current file
// (first save, or Load put a bad one aside) the old backup stays.
func (s *Store) linkBackup() error {
	bakTmp := s.bak + ".tmp"
	if err := os.Remove(bakTmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("save endpoints: %w", err)
	}
	if err := os.Link(s.file, bakTmp); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("save endpoints: back up %s: %w", s.file, err)
	}
	if err := os.Rename(bakTmp, s.bak); err != nil {
		os.Remove(bakTmp)
		return fmt.Errorf("save endpoints: back up %s: %w", s.file, err)
	}
	return nil
}

// encodeState writes one endpoint per line, so that the file reads and
// diffs well; the checksum covers the array exactly as written.
func encodeState(eps []*tables.Endpoint, seq uint64) ([]byte, error) {
	var arr bytes.Buffer
	arr.WriteByte('[')
	for i, ep := range eps {
		line, err := json.Marshal(ep)
		if err != nil {
			return nil, err
		}
		if i > 0 {
			arr.WriteByte(',')
		}
		arr.WriteString("\n    ")
		arr.Write(line)
	}
	if len(eps) > 0 {
		arr.WriteString("\n  ")
	}
	arr.WriteByte(']')
	sum := stateChecksum(stateVersion, seq, arr.Bytes())

	var out bytes.Buffer
	out.Grow(arr.Len() + 160)
	fmt.Fprintf(&out, "{\n  \"version\": %d,\n  \"journalSeq\": %d,\n  \"endpoints\": ", stateVersion, seq)
	out.Write(arr.Bytes())
	fmt.Fprintf(&out, ",\n  \"sha256\": %q\n}\n", hex.EncodeToString(sum[:]))
	return out.Bytes(), nil
}

func writeFileSync(name string, data []byte) error {
	// A stale .tmp from a crash may have another mode; O_TRUNC would keep it.
	if err := os.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("save endpoints: %w", err)
	}
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("save endpoints: %w", err)
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(name)
		return fmt.Errorf("save endpoints: write %s: %w", name, err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// LoadReport says where the endpoints came from and what was wrong.
type LoadReport struct {
	// Origin is "none" (no snapshot yet), "file" or "backup": the snapshot
	// the journal was replayed onto.
	Origin string
	// Replayed is the number of journal records applied to the snapshot.
	Replayed int
	// Problems are what an operator should hear about even though Load
	// succeeded: a bad file and what was done with it.
	Problems []string
}

// Load reads the snapshot, replays the journal onto it, and makes the
// result the store's state; Add and Delete append to that journal.
//
// The snapshot:
//   - No file and no backup: no endpoints, Origin "none".
//   - A good file: Origin "file". The backup is not read.
//   - A file that is missing, unreadable, truncated, fails its checksum or
//     holds invalid endpoints, and a good backup: the backup's endpoints,
//     Origin "backup". A bad file is renamed to
//     endpoints.json.corrupt-<unix-seconds> and kept for inspection; Problems
//     says what was wrong and what was done.
//   - Neither usable: an error naming both files and what is wrong with
//     each, and nothing on disk changes. The caller must refuse to start
//     rather than forget allocations.
//
// A file of an unknown version is an error too, whatever the backup holds:
// it is not damaged but written by another ipmasq (a downgrade), and
// falling back to an older backup would forget allocations made since.
//
// The journal (see journal.go): records the snapshot already includes are
// skipped, the others applied in order. A bad last line is a write the
// crash interrupted before it was acknowledged: it is dropped, cut off the
// file and reported. A bad line before the last, a gap in the record
// numbers, or a result that fails the snapshot's checks is an error naming
// the journal and the line, and nothing on disk changes: the records after
// a damaged one cannot be trusted to apply to what came before it.
func (s *Store) Load() ([]*tables.Endpoint, LoadReport, error) {
	s.fileMu.Lock()
	defer s.fileMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closeJournal()
	s.loaded, s.closed = false, false

	base, seq, report, putAside, err := s.readSnapshot()
	if err != nil {
		return nil, LoadReport{}, err
	}
	j, err := readJournal(s.journal)
	if err != nil {
		return nil, LoadReport{}, err
	}
	eps, replayed, problems, err := j.replay(base, seq, report.Origin)
	if err != nil {
		return nil, LoadReport{}, err
	}

	// Checked: now the disk may change.
	if putAside != nil {
		aside, err := s.putAside()
		if err != nil {
			return nil, LoadReport{}, fmt.Errorf("%v; the backup %s is good but the bad file cannot be put aside: %w", putAside, s.bak, err)
		}
		report.Problems = append(report.Problems,
			putAside.Error(),
			fmt.Sprintf("using the backup %s (allocations made since it was written and no longer in the journal, if any, are lost); the bad file is kept as %s", s.bak, aside))
	}
	if j.torn != "" {
		if err := truncateSync(s.journal, j.size); err != nil {
			return nil, LoadReport{}, fmt.Errorf("%s; cannot cut it off: %w", j.torn, err)
		}
		report.Problems = append(report.Problems, j.torn)
	}
	report.Problems = append(report.Problems, problems...)
	report.Replayed = replayed

	s.setState(eps, max(seq, j.lastSeq()))
	s.records, s.size = len(j.lines), j.size
	if err := s.openJournalLocked(); err != nil {
		s.loaded = false
		return nil, LoadReport{}, err
	}
	return eps, report, nil
}

// readSnapshot picks the snapshot to replay the journal onto. putAside is
// the error of a bad file that Load will put aside once it knows the
// journal applies.
func (s *Store) readSnapshot() (eps []*tables.Endpoint, seq uint64, report LoadReport, putAside error, err error) {
	eps, seq, fileErr := readState(s.file)
	if fileErr == nil {
		return eps, seq, LoadReport{Origin: "file"}, nil, nil
	}
	var verr *versionError
	if errors.As(fileErr, &verr) {
		return nil, 0, LoadReport{}, nil, fileErr
	}
	fileMissing := errors.Is(fileErr, fs.ErrNotExist)

	eps, seq, bakErr := readState(s.bak)
	if bakErr != nil {
		if fileMissing && errors.Is(bakErr, fs.ErrNotExist) {
			return []*tables.Endpoint{}, 0, LoadReport{Origin: "none"}, nil, nil
		}
		return nil, 0, LoadReport{}, nil, fmt.Errorf("no usable endpoints state, refusing to guess which addresses are allocated: %v; backup %v",
			describe(s.file, fileErr), describe(s.bak, bakErr))
	}
	report = LoadReport{Origin: "backup"}
	if fileMissing {
		report.Problems = append(report.Problems,
			fmt.Sprintf("%s does not exist; using the backup %s (allocations made since it was written and no longer in the journal, if any, are lost)", s.file, s.bak))
		return eps, seq, report, nil, nil
	}
	return eps, seq, report, fileErr, nil
}

// setState makes eps (valid) the store's endpoints, as of record seq.
func (s *Store) setState(eps []*tables.Endpoint, seq uint64) {
	s.eps = make(map[netip.Addr]*tables.Endpoint, len(eps))
	s.owners = make(map[ownerFamily]netip.Addr, len(eps))
	for _, ep := range eps {
		s.eps[ep.IP] = ep
		s.owners[ownerFamily{ep.Owner, ep.Family()}] = ep.IP
	}
	s.seq = seq
	s.loaded = true
}

// describe renders a read error for the "neither is usable" message.
func describe(name string, err error) string {
	if errors.Is(err, fs.ErrNotExist) {
		return name + ": does not exist"
	}
	return err.Error()
}

// putAside renames the bad state file to <file>.corrupt-<unix-seconds>,
// never over an earlier one.
func (s *Store) putAside() (string, error) {
	base := s.file + ".corrupt-" + strconv.FormatInt(time.Now().Unix(), 10)
	name := base
	for i := 2; ; i++ {
		if _, err := os.Lstat(name); errors.Is(err, fs.ErrNotExist) {
			break
		}
		name = base + "." + strconv.Itoa(i)
	}
	if err := os.Rename(s.file, name); err != nil {
		return "", err
	}
	if err := syncDir(s.dir); err != nil {
		return "", err
	}
	return name, nil
}

// versionError is a state file this ipmasq does not know how to read.
type versionError struct{ msg string }

func (e *versionError) Error() string { return e.msg }

// readState reads and checks one snapshot, and returns the last journal
// record it includes (0 for version 1). Errors name the file; a missing
// file is an fs.ErrNotExist.
func readState(name string) ([]*tables.Endpoint, uint64, error) {
	data, err := os.ReadFile(name)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, 0, err
		}
		return nil, 0, fmt.Errorf("%s: unreadable: %w", name, err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, 0, fmt.Errorf("%s: empty file (truncated)", name)
	}
	var h stateHeader
	if err := json.Unmarshal(data, &h); err != nil {
		return nil, 0, fmt.Errorf("%s: not valid JSON (file truncated or modified): %w", name, err)
	}
	switch {
	case h.Version == nil:
		return nil, 0, fmt.Errorf("%s: no \"version\" field; not an ipmasq endpoints file", name)
	case *h.Version != 1 && *h.Version != stateVersion:
		return nil, 0, &versionError{fmt.Sprintf("%s: unsupported version %d: this ipmasq reads versions 1 and %d only; was the file written by a newer ipmasq?",
			name, *h.Version, stateVersion)}
	case *h.Version > 1 && h.JournalSeq == nil:
		return nil, 0, fmt.Errorf("%s: no \"journalSeq\" field", name)
	case h.Endpoints == nil:
		return nil, 0, fmt.Errorf("%s: no \"endpoints\" field", name)
	case h.SHA256 == nil:
		return nil, 0, fmt.Errorf("%s: no \"sha256\" field", name)
	}
	var seq uint64
	if h.JournalSeq != nil && *h.Version > 1 {
		seq = *h.JournalSeq
	}
	sum := stateChecksum(*h.Version, seq, h.Endpoints)
	if want, err := hex.DecodeString(*h.SHA256); err != nil || !bytes.Equal(want, sum[:]) {
		return nil, 0, fmt.Errorf("%s: checksum mismatch (file truncated or modified)", name)
	}

	var eps []*tables.Endpoint
	if err := json.Unmarshal(h.Endpoints, &eps); err != nil {
		return nil, 0, fmt.Errorf("%s: invalid endpoints: %w", name, err)
	}
	if err := validateEndpoints(eps); err != nil {
		return nil, 0, fmt.Errorf("%s: %w", name, err)
	}
	if eps == nil {
		eps = []*tables.Endpoint{}
	}
	return eps, seq, nil
}

// validateEndpoints checks what the endpoints table and IPAM rely on: a
// valid, plain address per endpoint, an owner, no address twice and at
// most one address per owner and family.
func validateEndpoints(eps []*tables.Endpoint) error {
	byIP := make(map[netip.Addr]string, len(eps))
	byOwner := make(map[ownerFamily]netip.Addr, len(eps))
	for i, ep := range eps {
		switch {
		case ep == nil:
			return fmt.Errorf("endpoint %d is null", i)
		case !ep.IP.IsValid():
			return fmt.Errorf("endpoint %d (owner %q) has no valid ip", i, ep.Owner)
		case ep.IP.Is4In6():
			return fmt.Errorf("endpoint %d (owner %q): ip %s is IPv4-mapped; expected plain IPv4 %s", i, ep.Owner, ep.IP, ep.IP.Unmap())
		case ep.IP.Zone() != "":
			return fmt.Errorf("endpoint %d (owner %q): ip %s has a zone", i, ep.Owner, ep.IP)
		case ep.Owner == "":
			return fmt.Errorf("endpoint %d (ip %s) has an empty owner", i, ep.IP)
		}
		if other, dup := byIP[ep.IP]; dup {
			return fmt.Errorf("ip %s is allocated twice, to %q and %q", ep.IP, other, ep.Owner)
		}
		byIP[ep.IP] = ep.Owner
		k := ownerFamily{ep.Owner, ep.Family()}
		if other, dup := byOwner[k]; dup {
			return fmt.Errorf("owner %q holds two %s addresses, %s and %s; at most one per family", ep.Owner, k.family, other, ep.IP)
		}
		byOwner[k] = ep.IP
	}
	return nil
}
