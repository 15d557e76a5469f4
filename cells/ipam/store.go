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
	stateFile    = "endpoints.json"
	stateVersion = 1
)

// Store keeps the endpoints in <dir>/endpoints.json, and the previous good
// copy in <dir>/endpoints.json.bak, so that a crash or a corrupt file never
// loses allocations silently.
//
// Other names in dir: <file>.tmp is a save in progress (ignored by Load,
// overwritten by Save); <file>.corrupt-<unix-seconds> is a bad file that
// Load put aside for inspection (never read again, never removed).
type Store struct {
	dir, file, bak string

	mu sync.Mutex // one Save or Load at a time: they share the .tmp names
}

// NewStore creates dir (mode 0700) if needed.
func NewStore(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create IPAM state directory: %w", err)
	}
	file := filepath.Join(dir, stateFile)
	return &Store{dir: dir, file: file, bak: file + ".bak"}, nil
}

// Path is the state file, <dir>/endpoints.json.
func (s *Store) Path() string { return s.file }

// stateHeader is the part of the file read before the endpoints are
// trusted: the version says how to read the rest, the checksum whether
// the endpoints array is what was written.
type stateHeader struct {
	Version   *int            `json:"version"`
	Endpoints json.RawMessage `json:"endpoints"`
	SHA256    *string         `json:"sha256"`
}

// Save replaces the state file atomically and durably. The endpoints are
// written sorted by IP; they must pass the same checks as Load makes, so
// that a save never produces a file the next start refuses.
//
// The steps keep a complete, fsynced file under <file> or <file>.bak at
// every instant: write <file>.tmp and fsync it; hard-link the current file
// to <bak>.tmp and rename that over <bak> (the backup is never missing,
// and is the file as it was, not a copy that could be torn); rename
// <file>.tmp over <file>; fsync the directory. The directory is synced
// once, at the end: every name points at an fsynced inode throughout, so
// whichever renames a crash loses, each name still holds a good file.
func (s *Store) Save(eps []*tables.Endpoint) error {
	s.mu.Lock()
	defer s.mu.Unlock()

	sorted := slices.Clone(eps)
	slices.SortFunc(sorted, func(a, b *tables.Endpoint) int { return a.IP.Compare(b.IP) })
	if err := validateEndpoints(sorted); err != nil {
		return fmt.Errorf("refusing to save %s: %w", s.file, err)
	}
	data, err := encodeState(sorted)
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
func encodeState(eps []*tables.Endpoint) ([]byte, error) {
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
	sum := sha256.Sum256(arr.Bytes())

	var out bytes.Buffer
	out.Grow(arr.Len() + 128)
	fmt.Fprintf(&out, "{\n  \"version\": %d,\n  \"endpoints\": ", stateVersion)
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
	// Source is "none" (no state yet), "file" or "backup".
	Source string
	// Problems are what an operator should hear about even though Load
	// succeeded: a bad file and what was done with it.
	Problems []string
}

// Load reads the state.
//
//   - No file and no backup: no endpoints, Source "none".
//   - A good file: Source "file". The backup is not read.
//   - A file that is missing, unreadable, truncated, fails its checksum or
//     holds invalid endpoints, and a good backup: the backup's endpoints,
//     Source "backup". A bad file is renamed to
//     endpoints.json.corrupt-<unix-seconds> and kept for inspection; Problems
//     says what was wrong and what was done.
//   - Neither usable: an error naming both files and what is wrong with
//     each, and nothing on disk changes. The caller must refuse to start
//     rather than forget allocations.
//
// A file of an unknown version is an error too, whatever the backup holds:
// it is not damaged but written by another ipmasq (a downgrade), and
// falling back to an older backup would forget allocations made since.
func (s *Store) Load() ([]*tables.Endpoint, LoadReport, error) {
	s.mu.Lock()
	defer s.mu.Unlock()

	eps, fileErr := readState(s.file)
	if fileErr == nil {
		return eps, LoadReport{Source: "file"}, nil
	}
	var verr *versionError
	if errors.As(fileErr, &verr) {
		return nil, LoadReport{}, fileErr
	}
	fileMissing := errors.Is(fileErr, fs.ErrNotExist)

	eps, bakErr := readState(s.bak)
	if bakErr != nil {
		if fileMissing && errors.Is(bakErr, fs.ErrNotExist) {
			return nil, LoadReport{Source: "none"}, nil
		}
		return nil, LoadReport{}, fmt.Errorf("no usable endpoints state, refusing to guess which addresses are allocated: %v; backup %v",
			describe(s.file, fileErr), describe(s.bak, bakErr))
	}

	report := LoadReport{Source: "backup"}
	if fileMissing {
		report.Problems = append(report.Problems,
			fmt.Sprintf("%s does not exist; using the backup %s (allocations made since it was written, if any, are lost)", s.file, s.bak))
		return eps, report, nil
	}
	aside, err := s.putAside()
	if err != nil {
		return nil, LoadReport{}, fmt.Errorf("%v; the backup %s is good but the bad file cannot be put aside: %w", fileErr, s.bak, err)
	}
	report.Problems = append(report.Problems,
		fileErr.Error(),
		fmt.Sprintf("using the backup %s (allocations made since it was written, if any, are lost); the bad file is kept as %s", s.bak, aside))
	return eps, report, nil
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

// readState reads and checks one state file. Errors name the file; a
// missing file is an fs.ErrNotExist.
func readState(name string) ([]*tables.Endpoint, error) {
	data, err := os.ReadFile(name)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		return nil, fmt.Errorf("%s: unreadable: %w", name, err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, fmt.Errorf("%s: empty file (truncated)", name)
	}
	var h stateHeader
	if err := json.Unmarshal(data, &h); err != nil {
		return nil, fmt.Errorf("%s: not valid JSON (file truncated or modified): %w", name, err)
	}
	switch {
	case h.Version == nil:
		return nil, fmt.Errorf("%s: no \"version\" field; not an ipmasq endpoints file", name)
	case *h.Version != stateVersion:
		return nil, &versionError{fmt.Sprintf("%s: unsupported version %d: this ipmasq reads version %d only; was the file written by a newer ipmasq?",
			name, *h.Version, stateVersion)}
	case h.Endpoints == nil:
		return nil, fmt.Errorf("%s: no \"endpoints\" field", name)
	case h.SHA256 == nil:
		return nil, fmt.Errorf("%s: no \"sha256\" field", name)
	}
	sum := sha256.Sum256(h.Endpoints)
	if want, err := hex.DecodeString(*h.SHA256); err != nil || !bytes.Equal(want, sum[:]) {
		return nil, fmt.Errorf("%s: checksum mismatch (file truncated or modified)", name)
	}

	var eps []*tables.Endpoint
	if err := json.Unmarshal(h.Endpoints, &eps); err != nil {
		return nil, fmt.Errorf("%s: invalid endpoints: %w", name, err)
	}
	if err := validateEndpoints(eps); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if eps == nil {
		eps = []*tables.Endpoint{}
	}
	return eps, nil
}

// validateEndpoints checks what the endpoints table and IPAM rely on: a
// valid, plain address per endpoint, an owner, no address twice and at
// most one address per owner and family.
func validateEndpoints(eps []*tables.Endpoint) error {
	byIP := make(map[netip.Addr]string, len(eps))
	type ownerFamily struct {
		owner  string
		family tables.Family
	}
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
