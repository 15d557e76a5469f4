package config

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// MaxFileSize bounds how much of a config file is read. 16 384 prefixes per
// family take well under 2 MiB in either format.
const MaxFileSize = 16 << 20

// DefaultResyncInterval is the drift-repair and re-read interval when the
// file does not set resyncInterval (the Kubernetes agent's default).
const DefaultResyncInterval = 60 * time.Second

// loader turns the config file into table rows. It is driven by one
// goroutine (run), so it needs no locking.
type loader struct {
	log    *slog.Logger
	db     *statedb.DB
	cidrs  statedb.RWTable[*tables.NonMasqCIDR]
	status statedb.RWTable[*tables.ConfigStatus]
	rules  statedb.RWTable[*tables.MasqueradeRule]
	path   string
	limits Limits
	health cell.Health

	// markInitialized marks nonmasq-cidrs initialized; nil once done.
	markInitialized func(statedb.WriteTxn)
	// lastInput identifies the last file content handled, so the several
	// events of one ConfigMap update cost one parse.
	lastInput string
	resync    time.Duration
	// defaultResync is resync when the file sets no resyncInterval.
	defaultResync time.Duration
	// files is the state of each file read (path and the drop-ins beside
	// it), by path.
	files map[string]*fileState
}

// fileState is one merged file's last content and last good parse.
type fileState struct {
	input string  // hash of the content last read
	good  *parsed // the last content that was valid; nil: none yet
	err   error   // why the content last read was refused; nil: it is good
}

// emptyFileSettle is how long, twice over, an empty file must stay empty
// after a file with content before the defaults replace it: an in-place
// write truncates first, and the defaults would change what is masqueraded.
const emptyFileSettle = 50 * time.Millisecond

func newLoader(log *slog.Logger, db *statedb.DB, cidrs statedb.RWTable[*tables.NonMasqCIDR],
	status statedb.RWTable[*tables.ConfigStatus], rules statedb.RWTable[*tables.MasqueradeRule],
	path string, limits Limits, health cell.Health) *loader {
	l := &loader{
		log: log, db: db, cidrs: cidrs, status: status, rules: rules, path: path, limits: limits, health: health,
		resync: DefaultResyncInterval, defaultResync: DefaultResyncInterval,
	}
	wtxn := db.WriteTxn(cidrs, status, rules)
	markCIDRs := cidrs.RegisterInitializer(wtxn, "config-file")
	markRules := rules.RegisterInitializer(wtxn, "config-file")
	l.markInitialized = func(wtxn statedb.WriteTxn) {
		markCIDRs(wtxn)
		markRules(wtxn)
	}
	status.Insert(wtxn, &tables.ConfigStatus{Path: path, Origin: tables.ConfigOriginNone})
	wtxn.Commit()
	return l
}

// run loads the file on every change in its directory and every resync
// interval, until ctx is done. The first load happened at construction; one
// more right after the watch is armed catches a change in between.
func (l *loader) run(ctx context.Context) error {
	w, err := newDirWatcher(l.log, l.path)
	if err != nil {
		// Without a watch the file is still re-read every resync interval.
		l.log.Error("Cannot watch config directory; changes are picked up at each resync",
			"directory", filepath.Dir(l.path), "error", err)
	} else {
		go w.run(ctx)
	}
	var changed <-chan struct{}
	if w != nil {
		changed = w.Changed()
	}
	l.load()
	timer := time.NewTimer(l.resync)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-timer.C:
			// A periodic re-read catches anything the watch missed.
			l.lastInput = ""
		}
		l.load()
		timer.Reset(l.resync)
	}
}

// load reads, validates and applies the config once: the file at path
// and the ip-masq* files beside it (isDropIn), merged (merge.go); a file
// alone is the merge of one.
func (l *loader) load() {
	l.loadFiles(append([]string{l.path}, l.listDropIns()...))
}

// readConfigFile reads at most MaxFileSize bytes, refusing larger files
// rather than truncating them, and anything that is not a regular file
// (a FIFO would block the loader forever).
func readConfigFile(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file but %s; the config must be a file", path, fileKind(fi.Mode()))
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, err // *PathError: names the file
	}
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("%s: file is larger than %d MiB; a config this large is a mistake", path, MaxFileSize>>20)
	}
	return data, nil
}

func fileKind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	}
	return "a special file"
}

// reject records a bad file: the tables keep their rows, only the status
// row and health change.
func (l *loader) reject(err error) {
	l.log.Error("Config file rejected; keeping the last good config", "path", l.path, "error", err)
	l.health.Degraded("config file rejected, last good config kept", err)
	wtxn := l.db.WriteTxn(l.status)
	st := l.currentStatus(wtxn)
	st.LastError = err.Error()
	l.status.Insert(wtxn, st)
	wtxn.Commit()
}

func (l *loader) currentStatus(txn statedb.ReadTxn) *tables.ConfigStatus {
	st, _, ok := l.status.Get(txn, tables.ConfigStatusByPath.Query(l.path))
	if !ok {
		return &tables.ConfigStatus{Path: l.path, Origin: tables.ConfigOriginNone}
	}
	c := *st
	return &c
}

// applyMerged makes nonmasq-cidrs hold exactly entries, the rows of file
// (nil: no file), in one transaction, touching only rows that change.
// warnings are logged when they change, and kept in the status row; files
// are the merged files, if several; refused is the error of files that
// were refused while the others are applied (nil: none), recorded in the
// same transaction.
func (l *loader) applyMerged(file *File, entries []Entry, start time.Time, warnings []tables.ConfigWarning, files []string, refused error) {
	wtxn := l.db.WriteTxn(l.cidrs, l.status, l.rules)
	changed := l.applyRules(wtxn, file) + l.applyCIDRs(wtxn, entries)

	st := l.currentStatus(wtxn)
	// A periodic resync (or a touch of the file) that changes nothing is
	// logged at debug: at steady state the agent's INFO log stays quiet.
	// The first load, a change, a recovery from a rejected file and a
	// change of origin (file → defaults) are logged at INFO.
	unchanged := changed == 0 && st.Generation > 0 && st.LastError == ""
	prevOrigin := st.Origin
	newWarnings := !slices.Equal(st.Warnings, warnings)
	st.Warnings = warnings
	st.Files = files
	st.LastError = ""
	if refused != nil {
		st.LastError = refused.Error()
	}
	st.LastGoodLoad = time.Now()
	st.Origin = tables.ConfigOriginDefaults
	st.MasqueradeRules = 0
	l.resync = l.defaultResync
	if file != nil {
		st.Origin = tables.ConfigOriginFile
		st.MasqueradeRules = len(file.MasqueradeRules)
		if file.ResyncInterval > 0 {
			l.resync = file.ResyncInterval
		}
	}
	st.ResyncInterval = l.resync
	st.NoMasqV4, st.NoMasqV6, st.MasqExceptions = 0, 0, 0
	for _, e := range entries {
		switch {
		case e.Action == tables.ActionMasquerade:
			st.MasqExceptions++
		case e.Prefix.Addr().Is4():
			st.NoMasqV4++
		default:
			st.NoMasqV6++
		}
	}
	if changed > 0 || st.Generation == 0 {
		st.Generation++
	}
	l.status.Insert(wtxn, st)
	if l.markInitialized != nil {
		l.markInitialized(wtxn)
		l.markInitialized = nil
	}
	wtxn.Commit()

	level := slog.LevelInfo
	if unchanged && prevOrigin == st.Origin && !newWarnings {
		level = slog.LevelDebug
	}
	l.log.Log(context.Background(), level, "Config applied", "path", l.path, "origin", st.Origin, "generation", st.Generation,
		"changedPrefixes", changed, "noMasqIPv4", st.NoMasqV4, "noMasqIPv6", st.NoMasqV6,
		"masqueradeCIDRs", st.MasqExceptions, "duration", time.Since(start))
	for _, w := range warnings {
		// Loud while new, then once per re-read at debug.
		wl := slog.LevelWarn
		if !newWarnings {
			wl = slog.LevelDebug
		}
		l.log.Log(context.Background(), wl, "Config warning: "+w.Message, "path", l.path, "kind", w.Kind)
	}
	msg := fmt.Sprintf("config generation %d from %s (%s): %d IPv4 / %d IPv6 no-masquerade prefixes",
		st.Generation, l.path, st.Origin, st.NoMasqV4, st.NoMasqV6)
	if len(warnings) > 0 {
		msg += fmt.Sprintf("; %d warning(s), see config/status", len(warnings))
	}
	if refused != nil {
		l.log.Error("Config file rejected; the other files stay applied, with its last good content if it had one",
			"path", l.path, "error", refused)
		l.health.Degraded("config file rejected, the other files stay applied", refused)
		return
	}
	l.health.OK(msg)
}

// applyCIDRs makes nonmasq-cidrs hold exactly entries and returns how many
// rows changed. The table's rows and entries are walked side by side in one
// order, instead of through a map of 16 384 prefixes.
func (l *loader) applyCIDRs(wtxn statedb.WriteTxn, entries []Entry) int {
	rows := statedb.Collect(l.cidrs.All(wtxn))
	byPrefix := func(a, b *tables.NonMasqCIDR) int { return compareMasked(a.Prefix, b.Prefix) }
	if !slices.IsSortedFunc(rows, byPrefix) { // the index orders IPv6 below ::ffff:0:0 first
		slices.SortFunc(rows, byPrefix)
	}
	changed := 0
	i, j := 0, 0
	// The rows inserted by one load come from a few blocks, each twice the
	// last and never more than the entries left: a new 16 384-prefix file
	// was 16 384 small allocations, and the collections they caused slowed
	// the whole path to the maps. The map reconciler replaces
	// every row with a copy when it records its status, so a block is
	// garbage once its rows are reconciled (a row waiting for a retry
	// keeps its block, at most the size of the load).
	var block []tables.NonMasqCIDR
	// One pending status for the whole load: reading the clock for each
	// row took 60 ns on the 2-vCPU VM, 1 ms of a 16 384-prefix load. The
	// map reconciler commits its outcome by row revision (compare and
	// swap), not by the status's ID, so rows may share it.
	pending := reconciler.StatusPending()
	newRow := func(e Entry) *tables.NonMasqCIDR {
		if len(block) == cap(block) {
			block = make([]tables.NonMasqCIDR, 0, min(max(2*cap(block), 16), len(entries)-j))
		}
		block = append(block, tables.NonMasqCIDR{Prefix: e.Prefix, Action: e.Action, Origin: e.Origin, Status: pending})
		return &block[len(block)-1]
	}
	for i < len(rows) || j < len(entries) {
		c := 0
		switch {
		case i == len(rows):
			c = 1
		case j == len(entries):
			c = -1
		default:
			c = compareMasked(rows[i].Prefix, entries[j].Prefix)
		}
		switch {
		case c < 0: // no longer wanted
			l.cidrs.Delete(wtxn, rows[i])
			changed++
			i++
		case c > 0: // new
			l.cidrs.Insert(wtxn, newRow(entries[j]))
			changed++
			j++
		default:
			if e := entries[j]; e.Action != rows[i].Action || e.Origin != rows[i].Origin {
				l.cidrs.Insert(wtxn, newRow(e))
				changed++
			}
			i++
			j++
		}
	}
	return changed
}

// applyRules makes the masquerade-rules table hold the file's rules and
// returns how many rows changed.
func (l *loader) applyRules(wtxn statedb.WriteTxn, file *File) int {
	want := map[string]*tables.MasqueradeRule{}
	if file != nil {
		for _, r := range file.MasqueradeRules {
			want[r.Name] = &r
		}
	}
	changed := 0
	for row := range l.rules.All(wtxn) {
		w, ok := want[row.Name]
		switch {
		case !ok:
			l.rules.Delete(wtxn, row)
			changed++
		case !sameRule(w, row):
			l.rules.Insert(wtxn, w)
			changed++
		}
		delete(want, row.Name)
	}
	for _, w := range want {
		l.rules.Insert(wtxn, w)
		changed++
	}
	return changed
}

func sameRule(a, b *tables.MasqueradeRule) bool {
	return a.Name == b.Name && a.ToAddress == b.ToAddress &&
		slices.Equal(a.Sources, b.Sources) && slices.Equal(a.OutInterfaces, b.OutInterfaces)
}

// listDropIns returns the paths of the files merged with the config file
// (isDropIn), sorted by name as ip-masq-agent-v2 reads them.
func (l *loader) listDropIns() []string {
	dir, main := filepath.Dir(l.path), filepath.Base(l.path)
	des, err := os.ReadDir(dir) // sorted by name
	if err != nil {
		return nil
	}
	var out []string
	for _, de := range des {
		if isDropIn(de.Name(), main) {
			out = append(out, filepath.Join(dir, de.Name()))
		}
	}
	return out
}

// loadFiles reads paths (the config file first, then the drop-ins) and
// applies their merge. A file that is refused keeps its last good content
// in the merge, or adds nothing when it never had one, and is named in the
// status row, health, the log and the metrics until it is fixed: the other
// files stay applied. When no file read now is good, the tables are left
// as they are (reject). Absent files are skipped; with none, the defaults
// apply.
func (l *loader) loadFiles(paths []string) {
	start := time.Now()
	type read struct {
		path  string
		data  []byte
		input string
		err   error
	}
	var (
		reads []read
		all   strings.Builder
	)
	for _, p := range paths {
		data, err := readConfigFile(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			continue // the config file itself may be absent; a drop-in may be gone
		case err != nil:
			reads = append(reads, read{path: p, err: err})
			fmt.Fprintf(&all, "%s error %v\n", p, err)
			continue
		}
		if st := l.files[p]; len(bytes.TrimSpace(data)) == 0 && st != nil && st.good != nil && !isEmptyFile(st.good.file) {
			// An in-place write truncates before it writes: give the
			// writer a moment so a half-done save does not apply the
			// defaults.
			for range 2 {
				time.Sleep(emptyFileSettle)
				if data, err = readConfigFile(p); err != nil || len(bytes.TrimSpace(data)) > 0 {
					break
				}
			}
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			if err != nil {
				reads = append(reads, read{path: p, err: err})
				fmt.Fprintf(&all, "%s error %v\n", p, err)
				continue
			}
		}
		in := fmt.Sprintf("%x", sha256.Sum256(data))
		reads = append(reads, read{path: p, data: data, input: in})
		fmt.Fprintf(&all, "%s %s\n", p, in)
	}
	// Never empty, as lastInput is before the first load: no file at all
	// is an input too (the defaults).
	fmt.Fprintf(&all, "%d files", len(reads))
	if all.String() == l.lastInput {
		return
	}
	l.lastInput = all.String()

	states := make(map[string]*fileState, len(reads))
	var (
		good    []namedFile
		errs    []string
		goodNow bool
	)
	for _, r := range reads {
		st := l.files[r.path]
		if st == nil {
			st = &fileState{}
		}
		states[r.path] = st
		switch {
		case r.err != nil:
			st.input, st.err = "", r.err
		case r.input != st.input || (st.good == nil && st.err == nil):
			st.input = r.input
			if p, err := parse(r.path, r.data, l.limits); err != nil {
				st.err = err
			} else {
				st.good, st.err = p, nil
			}
		}
		if st.err != nil {
			errs = append(errs, st.err.Error())
		} else {
			goodNow = true
		}
		if st.good != nil {
			good = append(good, namedFile{path: r.path, p: st.good})
		}
	}
	l.files = states

	switch {
	case len(reads) == 0: // no file: the defaults
		l.applyMerged(nil, (*File)(nil).Entries(l.limits), start, nil, nil, nil)
		return
	case !goodNow:
		l.reject(errors.New(strings.Join(errs, "; ")))
		return
	}
	file, entries, warnings, err := merge(good, l.limits)
	if err != nil {
		l.reject(err)
		return
	}
	var names []string
	if len(good) > 1 {
		for _, nf := range good {
			names = append(names, filepath.Base(nf.path))
		}
	}
	var refused error
	if len(errs) > 0 {
		refused = errors.New(strings.Join(errs, "; "))
	}
	l.applyMerged(file, entries, start, warnings, names, refused)
}

// isEmptyFile reports whether f sets nothing (the content was empty).
func isEmptyFile(f *File) bool {
	return f == nil || (!f.NonMasqueradeCIDRsSet && len(f.MasqueradeCIDRs) == 0 && !f.MasqLinkLocal &&
		!f.MasqLinkLocalIPv6 && f.ResyncInterval == 0 && f.CIDRLimit == 0 && len(f.MasqueradeRules) == 0)
}
