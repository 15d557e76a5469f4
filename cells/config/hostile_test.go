package config

// Hostile config: every bad input, whether bad content or a bad path, must
// give the operator one clear line naming the file, and must change nothing
// in the tables. The small inputs are committed in testdata/hostile (they
// also seed FuzzParse); the big and special ones (100 000 entries,
// a 50 MiB file, a symlink loop, a directory, an unreadable path, a FIFO)
// are made at run time.

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

const hostileDir = "../../testdata/hostile"

// hostileGood is the last good config every case must leave in place.
const hostileGood = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n"

// hostileCase is one hostile input. Either file (a corpus file) or put (a
// run-time construction at path) is set.
type hostileCase struct {
	name string
	file string
	put  func(t *testing.T, path string)
	// restore puts good content at path without passing through an absent
	// file (which would apply the defaults); nil: an atomic rename.
	restore func(t *testing.T, path string, good []byte)
	// want is a case-specific substring of the error.
	want string
	// noIPv6 runs the agent with --enable-ipv6=false.
	noIPv6 bool
}

func hostileCorpusCases() []hostileCase {
	return []hostileCase{
		{name: "malformed YAML", file: "malformed.yaml", want: "invalid YAML"},
		{name: "malformed JSON", file: "malformed.json", want: "invalid JSON at line 1"},
		{name: "truncated JSON", file: "truncated.json", want: "truncated"},
		{name: "string for list", file: "wrong-type-string-for-list.yaml", want: "nonMasqueradeCIDRs: got a string, want a list"},
		{name: "list for bool", file: "wrong-type-list-for-bool.yaml", want: "masqLinkLocal: got a list, want true or false"},
		{name: "number for string", file: "wrong-type-number-for-string.json", want: "resyncInterval: got a number, want a duration string"},
		// An unknown key is ignored, not the bad value of a known one.
		{name: "unknown key beside a bad value", file: "unknown-key-bad-value.yaml", want: "nonMasqueradeCIDRs[1]: 192.168.1.1/16 has host bits set"},
		{name: "host bits", file: "host-bits.yaml", want: "nonMasqueradeCIDRs[1]: 192.168.1.1/16 has host bits set; did you mean 192.168.0.0/16?"},
		{name: "bad CIDR", file: "bad-cidr.yaml", want: `nonMasqueradeCIDRs[1]: "10.0.0.0/33" is not a CIDR`},
		{name: "IPv6 while disabled", file: "ipv6-disabled.yaml", noIPv6: true, want: "nonMasqueradeCIDRs[1]: fd00::/8 is IPv6 but IPv6 is disabled (--enable-ipv6=false)"},
		{name: "YAML alias bomb", file: "alias-bomb.yaml", want: "alias"},
		{name: "binary garbage", file: "binary-garbage.bin", want: "invalid YAML"},
		{name: "NUL bytes", file: "nul-bytes.yaml", want: "invalid YAML"},
		{name: "BOM and garbage", file: "bom-garbage.yaml", want: "the file must be a mapping"},
		{name: "huge line", file: "huge-line.yaml", want: "nonMasqueradeCIDRs[0]"},
		{name: "rule without sources", file: "rules-empty-sources.yaml", want: "masqueradeRules[0] (vpn): sources is required"},
		{name: "duplicate rule names", file: "rules-duplicate-names.yaml", want: `masqueradeRules[1] (vpn): name "vpn" is already used by masqueradeRules[0]`},
		{name: "bad interface pattern", file: "rules-bad-pattern.yaml", want: `outInterfaces[0]: interface name "eth+0": '+' is only allowed at the end`},
		{name: "toAddress of the wrong family", file: "rules-toaddress-family.yaml", want: "toAddress fd00::5 is IPv6 but source 10.8.0.0/24 is IPv4"},
	}
}

func hostileSpecialCases() []hostileCase {
	return []hostileCase{
		{
			name: "100 000 entries",
			put: func(t *testing.T, path string) {
				var b strings.Builder
				b.WriteString("masqLinkLocal: true\nnonMasqueradeCIDRs:\n")
				for i := range 100_000 {
					fmt.Fprintf(&b, "- 10.%d.%d.%d/32\n", i>>16, i>>8&0xff, i&0xff)
				}
				hostileWrite(t, path, []byte(b.String()))
			},
			want: "100000 IPv4 prefixes (nonMasqueradeCIDRs, masqueradeCIDRs and link-local) exceed the map capacity of 16384 (--max-nonmasq-cidrs)",
		},
		{
			name: "50 MiB file",
			put: func(t *testing.T, path string) {
				// A comment line repeated: valid YAML, so only the size
				// limit can reject it.
				chunk := []byte(strings.Repeat("# padding padding padding padding padding padding\n", (1<<20)/50))
				hostileWriteFunc(t, path, func(f *os.File) {
					for written := 0; written < 50<<20; written += len(chunk) {
						if _, err := f.Write(chunk); err != nil {
							t.Fatal(err)
						}
					}
				})
			},
			want: "file is larger than 16 MiB",
		},
		{
			name: "symlink loop",
			put: func(t *testing.T, path string) {
				// path -> path.loop -> path
				if err := os.Symlink(path, path+".loop"); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(path+".loop", path+".tmp"); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(path+".tmp", path); err != nil {
					t.Fatal(err)
				}
			},
			want: "too many levels of symbolic links",
		},
		{
			name: "directory",
			put: func(t *testing.T, path string) {
				// Swapped in atomically: removing the file first would
				// apply the defaults in between.
				if err := os.Mkdir(path+".swap", 0o755); err != nil {
					t.Fatal(err)
				}
				hostileExchange(t, path+".swap", path)
				hostileRemove(t, path+".swap")
			},
			restore: func(t *testing.T, path string, good []byte) {
				if err := os.WriteFile(path+".swap", good, 0o644); err != nil {
					t.Fatal(err)
				}
				hostileExchange(t, path+".swap", path)
				hostileRemove(t, path+".swap")
			},
			want: "not a regular file but a directory",
		},
		{
			// The config directory replaced by a regular file: open fails
			// with ENOTDIR. This stands in for an unreadable path when the
			// test runs as root, which permission bits do not stop.
			name: "path through a file",
			put: func(t *testing.T, path string) {
				dir := filepath.Dir(path)
				if err := os.WriteFile(dir+".swap", []byte(hostileGood), 0o644); err != nil {
					t.Fatal(err)
				}
				hostileExchange(t, dir+".swap", dir)
			},
			restore: func(t *testing.T, path string, good []byte) {
				dir := filepath.Dir(path)
				hostileExchange(t, dir+".swap", dir)
				hostileWrite(t, path, good)
			},
			want: "not a directory",
		},
		{
			name: "FIFO",
			put: func(t *testing.T, path string) {
				if err := syscall.Mkfifo(path+".tmp", 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(path+".tmp", path); err != nil {
					t.Fatal(err)
				}
			},
			want: "not a regular file but a named pipe",
		},
	}
}

// TestReadConfigFileFIFO: a FIFO at the config path is refused at once; a
// plain open would block the loader until a writer appeared.
func TestReadConfigFileFIFO(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := readConfigFile(fifo)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "not a regular file but a named pipe") {
			t.Fatalf("readConfigFile on a FIFO: %v", err)
		}
	case <-time.After(2 * time.Second):
		// Unblock it so the test binary can exit.
		if w, err := os.OpenFile(fifo, os.O_RDWR, 0); err == nil {
			w.Close()
		}
		t.Fatal("readConfigFile blocked on a FIFO")
	}
}

func TestHostileConfig(t *testing.T) {
	cases := append(hostileCorpusCases(), hostileSpecialCases()...)
	if os.Geteuid() != 0 {
		cases = append(cases, permissionDeniedCase())
	} else {
		// Root reads a mode-000 file (CAP_DAC_OVERRIDE); "path through a
		// file" stands in for an unreadable path.
		t.Log("running as root: the permission-denied case cannot be built")
	}
	// Every committed corpus file has a case.
	files, err := os.ReadDir(hostileDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if !slices.ContainsFunc(cases, func(c hostileCase) bool { return c.file == f.Name() }) {
			t.Errorf("corpus file %s has no case in TestHostileConfig", f.Name())
		}
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { runHostileCase(t, tc) })
	}
}

// hostileHive is the config cell in the smallest hive that runs it.
type hostileHive struct {
	db     *statedb.DB
	cidrs  statedb.Table[*tables.NonMasqCIDR]
	rules  statedb.Table[*tables.MasqueradeRule]
	status statedb.Table[*tables.ConfigStatus]
	health *cell.SimpleHealth
}

func startHostileHive(t *testing.T, path string, noIPv6 bool) *hostileHive {
	var hh hostileHive
	h := hive.New(
		statedb.Cell, job.Cell, cell.SimpleHealthCell,
		settings.Cell, Cell,
		cell.Invoke(func(db *statedb.DB, c statedb.Table[*tables.NonMasqCIDR], r statedb.Table[*tables.MasqueradeRule],
			s statedb.Table[*tables.ConfigStatus], health *cell.SimpleHealth) {
			hh = hostileHive{db: db, cidrs: c, rules: r, status: s, health: health}
		}),
	)
	hive.AddConfigOverride(h, func(c *Config) { c.IPMasqAgentConfigPath = path })
	// Both families unless the case says otherwise (IPv6 is off by default).
	hive.AddConfigOverride(h, func(c *settings.Config) { c.EnableIPv6 = !noIPv6 })
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return &hh
}

// hostileSnapshot is what a rejected file must not change.
type hostileSnapshot struct {
	cidrs     []Entry
	cidrsRev  statedb.Revision
	rules     []*tables.MasqueradeRule
	rulesRev  statedb.Revision
	status    tables.ConfigStatus
	statusRev statedb.Revision
}

func (hh *hostileHive) snapshot() hostileSnapshot {
	txn := hh.db.ReadTxn()
	var s hostileSnapshot
	for row := range hh.cidrs.All(txn) {
		s.cidrs = append(s.cidrs, Entry{Prefix: row.Prefix, Action: row.Action, Origin: row.Origin})
	}
	s.cidrsRev = hh.cidrs.Revision(txn)
	for row := range hh.rules.All(txn) {
		s.rules = append(s.rules, row)
	}
	s.rulesRev = hh.rules.Revision(txn)
	for st, rev := range hh.status.All(txn) {
		s.status, s.statusRev = *st, rev
	}
	return s
}

// waitStatus waits until the status row satisfies ok, for at most 5 s.
func (hh *hostileHive) waitStatus(t *testing.T, what string, ok func(*tables.ConfigStatus) bool) *tables.ConfigStatus {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		txn := hh.db.ReadTxn()
		var last *tables.ConfigStatus
		var watch <-chan struct{}
		for st := range hh.status.All(txn) {
			last = st
		}
		_, watch = hh.status.AllWatch(txn)
		if last != nil && ok(last) {
			return last
		}
		select {
		case <-watch:
		case <-deadline:
			t.Fatalf("timed out waiting for %s; status: %+v", what, last)
		}
	}
}

func runHostileCase(t *testing.T, tc hostileCase) {
	dir := filepath.Join(t.TempDir(), "config")
	path := filepath.Join(dir, "ip-masq-agent")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	hostileWrite(t, path, []byte(hostileGood))
	hh := startHostileHive(t, path, tc.noIPv6)
	wantRows := []Entry{{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Action: tables.ActionNoMasquerade, Origin: tables.OriginConfig}}
	if tc.noIPv6 {
		// masqLinkLocalIPv6 is false but IPv6 is off: no fe80::/10 row.
	} else {
		wantRows = append(wantRows, Entry{Prefix: netip.MustParsePrefix("fe80::/10"), Action: tables.ActionNoMasquerade, Origin: tables.OriginLinkLocal})
	}
	hh.waitStatus(t, "the good config", func(st *tables.ConfigStatus) bool {
		return st.Origin == tables.ConfigOriginFile && st.LastError == "" && st.Generation > 0
	})
	good := hh.snapshot()
	if !reflect.DeepEqual(good.cidrs, wantRows) {
		t.Fatalf("good config: nonmasq-cidrs holds %v, want %v", good.cidrs, wantRows)
	}

	start := time.Now()
	if tc.file != "" {
		data, err := os.ReadFile(filepath.Join(hostileDir, tc.file))
		if err != nil {
			t.Fatal(err)
		}
		hostileWrite(t, path, data)
	} else {
		tc.put(t, path)
	}
	st := hh.waitStatus(t, "the rejection", func(st *tables.ConfigStatus) bool { return st.LastError != "" })
	msg := st.LastError
	t.Logf("rejected in %v: %s", time.Since(start).Round(time.Millisecond), hostileShorten(msg))

	if !strings.Contains(msg, path) {
		t.Errorf("error does not name the file %s: %s", path, hostileShorten(msg))
	}
	if !strings.Contains(msg, tc.want) {
		t.Errorf("error does not say %q: %s", tc.want, hostileShorten(msg))
	}
	if strings.ContainsAny(msg, "\r\n") {
		t.Errorf("error is more than one line: %q", hostileShorten(msg))
	}
	if len(msg) > 1024 {
		t.Errorf("error is %d bytes long, want at most 1 KiB: %s", len(msg), hostileShorten(msg))
	}

	after := hh.snapshot()
	if !reflect.DeepEqual(after.cidrs, good.cidrs) || after.cidrsRev != good.cidrsRev {
		t.Errorf("nonmasq-cidrs changed: %v (revision %d), want %v (revision %d)",
			after.cidrs, after.cidrsRev, good.cidrs, good.cidrsRev)
	}
	if !reflect.DeepEqual(after.rules, good.rules) || after.rulesRev != good.rulesRev {
		t.Errorf("masquerade-rules changed: %v (revision %d), want %v (revision %d)",
			after.rules, after.rulesRev, good.rules, good.rulesRev)
	}
	if after.status.Generation != good.status.Generation || after.status.Origin != good.status.Origin ||
		after.status.NoMasqV4 != good.status.NoMasqV4 || after.status.NoMasqV6 != good.status.NoMasqV6 {
		t.Errorf("ipmasq-config status changed beyond LastError: %+v, was %+v", after.status, good.status)
	}
	// Health is set Degraded before the status row is written.
	hh.waitHealth(t, cell.StatusDegraded, msg)

	// A good file (different content, so it is not skipped as unchanged)
	// restores OK.
	restored := []byte("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\nmasqLinkLocal: true\n")
	if tc.restore != nil {
		tc.restore(t, path, restored)
	} else {
		hostileWrite(t, path, restored)
	}
	hh.waitStatus(t, "the restoring good config", func(st *tables.ConfigStatus) bool {
		return st.LastError == "" && st.Origin == tables.ConfigOriginFile && st.NoMasqV4 == 2
	})
	// Health is set OK just after the status row is written.
	hh.waitHealth(t, cell.StatusOK, "")
}

// waitHealth waits until the config-file health scope is at level (with
// error errMsg when Degraded), for at most 5 s.
func (hh *hostileHive) waitHealth(t *testing.T, level cell.Level, errMsg string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var got cell.Level
		var gotErr error
		if scope := hh.health.GetChild("config-file"); scope != nil {
			scope.Lock()
			got, gotErr = scope.Level, scope.Error
			scope.Unlock()
		}
		if got == level && (level != cell.StatusDegraded || gotErr != nil && gotErr.Error() == errMsg) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("config-file health is %q (%v), want %q", got, gotErr, level)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestHostileSameContentAfterReadError: after a read error (here a symlink
// loop), putting back the very content that was applied before must clear
// the error.
func TestHostileSameContentAfterReadError(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "config")
	path := filepath.Join(dir, "ip-masq-agent")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	hostileWrite(t, path, []byte(hostileGood))
	hh := startHostileHive(t, path, false)
	hh.waitStatus(t, "the good config", func(st *tables.ConfigStatus) bool {
		return st.Origin == tables.ConfigOriginFile && st.LastError == ""
	})
	for _, c := range hostileSpecialCases() {
		if c.name == "symlink loop" {
			c.put(t, path)
		}
	}
	hh.waitStatus(t, "the rejection", func(st *tables.ConfigStatus) bool { return st.LastError != "" })
	hostileWrite(t, path, []byte(hostileGood))
	deadline := time.After(time.Second)
	for {
		txn := hh.db.ReadTxn()
		st, _, watch, _ := hh.status.GetWatch(txn, tables.ConfigStatusByPath.Query(path))
		if st.LastError == "" {
			return
		}
		select {
		case <-watch:
		case <-deadline:
			t.Fatalf("the same good content after a read error was not applied again; LastError stays %q", st.LastError)
		}
	}
}

// TestHostileReadLimit: a file over MaxFileSize is refused after reading
// MaxFileSize+1 bytes, not read whole.
func TestHostileReadLimit(t *testing.T) {
	path := filepath.Join(t.TempDir(), "big")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	// Sparse: the size is what matters here, not the content.
	if err := f.Truncate(50 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err = readConfigFile(path)
	runtime.ReadMemStats(&after)
	if err == nil || !strings.Contains(err.Error(), "larger than 16 MiB") {
		t.Fatalf("readConfigFile(50 MiB) = %v, want a size error", err)
	}
	// io.ReadAll grows its buffer by doubling, so reading MaxFileSize+1
	// bytes allocates up to about 3x that in total; reading the whole
	// 50 MiB would allocate well over 100 MiB.
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 3*MaxFileSize {
		t.Errorf("reading a 50 MiB file allocated %d MiB; it is read beyond the limit", alloc>>20)
	} else {
		t.Logf("reading a 50 MiB file allocated %d MiB", alloc>>20)
	}
}

// TestHostileCorpusParse: Parse rejects every corpus file directly (no hive):
// an error, never a panic, one line starting with the file name.
// FuzzParse's own seeds already run in every go test.
func TestHostileCorpusParse(t *testing.T) {
	for _, tc := range hostileCorpusCases() {
		data, err := os.ReadFile(filepath.Join(hostileDir, tc.file))
		if err != nil {
			t.Fatal(err)
		}
		lim := Limits{EnableIPv4: true, EnableIPv6: !tc.noIPv6, MaxCIDRsPerFamily: 16384}
		f, err := Parse("hostile.yaml", data, lim)
		if err == nil {
			t.Errorf("%s: Parse accepted it: %+v", tc.file, f)
			continue
		}
		if msg := err.Error(); !strings.HasPrefix(msg, "hostile.yaml: ") || strings.ContainsAny(msg, "\r\n") {
			t.Errorf("%s: error is not one line starting with the file name: %q", tc.file, hostileShorten(msg))
		}
	}
}

// addHostileSeeds seeds a fuzzer with the hostile corpus, with both
// families on and with IPv6 off and no capacity limit.
func addHostileSeeds(f *testing.F) {
	files, err := os.ReadDir(hostileDir)
	if err != nil {
		f.Fatal(err)
	}
	for _, e := range files {
		data, err := os.ReadFile(filepath.Join(hostileDir, e.Name()))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data, uint8(3), uint8(4))
		f.Add(data, uint8(1), uint8(0))
	}
}

// hostileWrite replaces path atomically, as a ConfigMap update or an
// editor's save does.
func hostileWrite(t *testing.T, path string, data []byte) {
	t.Helper()
	hostileWriteFunc(t, path, func(f *os.File) {
		if _, err := f.Write(data); err != nil {
			t.Fatal(err)
		}
	})
}

func hostileWriteFunc(t *testing.T, path string, write func(*os.File)) {
	t.Helper()
	f, err := os.OpenFile(path+".tmp", os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	write(f)
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

// hostileExchange swaps a and b atomically (renameat2 RENAME_EXCHANGE), so
// the config path never goes absent.
func hostileExchange(t *testing.T, a, b string) {
	t.Helper()
	if err := unix.Renameat2(unix.AT_FDCWD, a, unix.AT_FDCWD, b, unix.RENAME_EXCHANGE); err != nil {
		t.Fatalf("exchange %s and %s: %v", a, b, err)
	}
}

func hostileRemove(t *testing.T, path string) {
	t.Helper()
	if err := os.RemoveAll(path); err != nil {
		t.Fatal(err)
	}
}

// hostileShorten keeps test output readable when an error quotes a huge value.
func hostileShorten(s string) string {
	if len(s) > 300 {
		return fmt.Sprintf("%s...(%d bytes)...%s", s[:200], len(s), s[len(s)-80:])
	}
	return s
}

// permissionDeniedCase is a file with mode 000, unreadable for non-root.
func permissionDeniedCase() hostileCase {
	return hostileCase{
		name: "permission denied",
		put: func(t *testing.T, path string) {
			hostileWriteFunc(t, path, func(f *os.File) {
				if _, err := f.WriteString(hostileGood); err != nil {
					t.Fatal(err)
				}
				if err := f.Chmod(0); err != nil {
					t.Fatal(err)
				}
			})
		},
		want: "permission denied",
	}
}
