package datapath

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/internal/cgroupmem"
)

func TestConntrackDefaultMax(t *testing.T) {
	const mib, gib = 1 << 20, 1 << 30
	for _, c := range []struct {
		ram  uint64
		want uint64
	}{
		{64 * mib, 1024}, // 512 buckets by memory: Linux's floor
		{512 * mib, 4096},
		{gib, 8192},
		{gib + 4096, 65536},
		{4 * gib, 65536},
		{4*gib + 4096, 262144},
		{24 * gib, 262144}, // the test machines: nf_conntrack_max 262144
		{1024 * gib, 262144},
	} {
		if got := conntrackDefaultMax(c.ram); got != c.want {
			t.Errorf("conntrackDefaultMax(%d MiB) = %d, want %d", c.ram>>20, got, c.want)
		}
	}
}

func TestDefaultNATEntries(t *testing.T) {
	const gib = 1 << 30
	for _, c := range []struct {
		name         string
		ram, ctMax   uint64
		wantPerMap   uint32
		wantAtLeastF uint64 // flows a single-family node holds
	}{
		{"no conntrack, 24 GiB", 24 * gib, 0, 524288, 262144},
		{"conntrack at Linux's default", 24 * gib, 262144, 524288, 262144},
		{"conntrack raised by the operator", 24 * gib, 1 << 20, 2 << 20, 1 << 20},
		{"conntrack lowered: Linux's default for the memory still", 24 * gib, 1000, 524288, 262144},
		{"small node", gib, 0, 16384, 8192},
		{"absurd conntrack_max is bounded", 24 * gib, 1 << 40, maxNATEntries, maxNATEntries / 2},
	} {
		got := defaultNATEntries(c.ram, c.ctMax)
		if got != c.wantPerMap {
			t.Errorf("%s: %d entries per map, want %d", c.name, got, c.wantPerMap)
		}
		if uint64(got)/2 < c.wantAtLeastF {
			t.Errorf("%s: %d entries hold %d flows, fewer than %d", c.name, got, got/2, c.wantAtLeastF)
		}
	}
}

// TestSizeNATMaps reads the node's files: memory and, when conntrack is
// loaded, nf_conntrack_max; a configured size is kept whatever they say.
func TestSizeNATMaps(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	meminfo := write("meminfo", "MemTotal:       24683584 kB\nMemFree:         1000 kB\n")
	small := write("meminfo-small", "MemFree:         1000 kB\nMemTotal:       1048576 kB\n")
	ctMax := write("nf_conntrack_max", "1048576\n")
	noCT := filepath.Join(dir, "absent")

	in := func(configured uint32, mem, ct string) natInputs {
		return natInputs{Configured: configured, Meminfo: mem, ConntrackMax: ct, IPv4: true}
	}
	s, err := sizeNATMaps(in(0, meminfo, ctMax))
	if err != nil || s.Entries != 2<<20 || s.Configured {
		t.Errorf("24 GiB, nf_conntrack_max 1048576: %+v %v, want 2097152 entries", s, err)
	}
	if !strings.Contains(s.String(), "nf_conntrack_max 1048576 from "+ctMax) {
		t.Errorf("log line %q does not say where the size comes from", s)
	}
	if s, err := sizeNATMaps(in(0, small, noCT)); err != nil || s.Entries != 16384 {
		t.Errorf("1 GiB, no conntrack: %+v %v, want 16384 entries", s, err)
	}
	// A configured size is kept, even one far below the node's conntrack.
	for _, n := range []uint32{64, 131072, 1 << 22} {
		if s, err := sizeNATMaps(in(n, meminfo, ctMax)); err != nil || s.Entries != n || !s.Configured {
			t.Errorf("--nat-max-entries=%d: %+v %v", n, s, err)
		}
		if s, err := sizeNATMaps(in(n, noCT, noCT)); err != nil || s.Entries != n {
			t.Errorf("--nat-max-entries=%d without /proc files: %+v %v", n, s, err)
		}
	}
	// Unreadable input is an error that names the file.
	bad := write("bad-ct", "lots\n")
	if _, err := sizeNATMaps(in(0, meminfo, bad)); err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("bad nf_conntrack_max: %v", err)
	}
	if _, err := sizeNATMaps(in(0, write("no-total", "MemFree: 1 kB\n"), ctMax)); err == nil || !strings.Contains(err.Error(), "MemTotal") {
		t.Errorf("meminfo without MemTotal: %v", err)
	}
}

// TestSizeNATMapsUnderAMemoryLimit: a 32-core node whose kube-proxy set
// nf_conntrack_max to 32 768 per core wants 2 097 152 entries a family;
// under the container's memory limit the maps get what the Go heap and the
// rest leave, and the log says so. Without a limit nothing changes.
func TestSizeNATMapsUnderAMemoryLimit(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	meminfo := write("meminfo", "MemTotal:       134217728 kB\n") // 128 GiB
	kubeProxy := write("nf_conntrack_max", "1048576\n")           // 32768 x 32 cores
	const mib = 1 << 20
	limit := func(b int64) cgroupmem.Limit { return cgroupmem.Limit{Bytes: b, File: "/sys/fs/cgroup/x/memory.max"} }
	for _, c := range []struct {
		name       string
		limit      int64
		goMem      int64
		v6         bool
		configured uint32
		entries    uint32
		capped     bool
		says       string
	}{
		{name: "no limit", entries: 2 << 20, says: "not bounded by one"},
		// 512 Mi: 128 Mi Go heap, 48 Mi rest, 336 Mi: IPv4's 2 Mi entries
		// of 128 bytes fit
		{name: "512 Mi, IPv4", limit: 512 * mib, entries: 2 << 20,
			says: "container memory limit 512 MiB (/sys/fs/cgroup/x/memory.max): 128 MiB for the Go heap, 48 MiB for the rest, 336 MiB for the NAT maps (they take 256 MiB)"},
		{name: "384 Mi, IPv4", limit: 384 * mib, entries: 208 * mib / 128 / 1024 * 1024, capped: true,
			says: "1703936 entries per family, fewer than the 2097152 entries per family"},
		{name: "512 Mi, both families", limit: 512 * mib, v6: true, entries: 336 * mib / (128 + 182) / 1024 * 1024, capped: true},
		{name: "512 Mi with GOMEMLIMIT=300MiB", limit: 512 * mib, goMem: 300 * mib, entries: 164 * mib / 128 / 1024 * 1024, capped: true,
			says: "300 MiB for the Go heap"},
		{name: "4 Gi: a quarter for the Go heap", limit: 4096 * mib, entries: 2 << 20, says: "1024 MiB for the Go heap"},
		{name: "too small", limit: 160 * mib, entries: minLimitedNATEntries, capped: true, says: "TOO SMALL"},
		{name: "configured, over the budget", limit: 512 * mib, configured: 4 << 20, entries: 4 << 20, says: "OVER the budget"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := sizeNATMaps(natInputs{Meminfo: meminfo, ConntrackMax: kubeProxy, Limit: limit(c.limit), GoMemLimit: c.goMem,
				IPv4: true, IPv6: c.v6, Configured: c.configured})
			if err != nil {
				t.Fatal(err)
			}
			if s.Entries != c.entries || s.CappedByLimit != c.capped {
				t.Errorf("%d entries (capped %v), want %d (%v): %s", s.Entries, s.CappedByLimit, c.entries, c.capped, s)
			}
			if !strings.Contains(s.String(), c.says) {
				t.Errorf("log line %q lacks %q", s, c.says)
			}
			if c.limit > 0 && !s.TooSmall && !s.OverBudget {
				// The maps, the Go heap's soft limit and the slack fit.
				if total := s.Bytes() + s.GoSoftLimit() + natSlack; total > c.limit {
					t.Errorf("maps %d + Go %d + slack %d = %d MiB over the %d MiB limit", s.Bytes()>>20, s.GoSoftLimit()>>20, natSlack>>20, total>>20, c.limit>>20)
				}
			}
		})
	}
}

// TestDeployDocsNATSizes: docs/deploy.md's table of NAT map sizes per node
// size is what sizeNATMaps gives under the DaemonSet's memory limit and
// GOMEMLIMIT, for each row's conntrack size: the entries a family wants,
// and what IPv4 alone and both families get, with their MiB.
func TestDeployDocsNATSizes(t *testing.T) {
	data, err := os.ReadFile("../../docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(data), "\n### NAT maps and the memory limit\n")
	if !ok {
		t.Fatal("docs/deploy.md: no section \"NAT maps and the memory limit\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	const mib = 1 << 20
	const limit, goMem = 512 * mib, 300 * mib
	if !strings.Contains(strings.Join(strings.Fields(section), " "), "512 Mi limit and `GOMEMLIMIT=300MiB`") {
		t.Fatalf("docs/deploy.md: the table's limit and GOMEMLIMIT are not the 512 Mi and 300MiB this test sizes with")
	}
	// "1 343 488 (164, capped)": entries, MiB, capped.
	cell := regexp.MustCompile(`^([0-9 ]+) \(([0-9]+)(, capped)?\)$`)
	num := func(s string) int64 {
		n, err := strconv.ParseInt(strings.ReplaceAll(strings.TrimSpace(s), " ", ""), 10, 64)
		if err != nil {
			t.Fatalf("docs/deploy.md: %q is not a number", s)
		}
		return n
	}
	dir := t.TempDir()
	meminfo := filepath.Join(dir, "meminfo")
	// 64 MiB: Linux's default for it (1 024) is below every row's.
	if err := os.WriteFile(meminfo, []byte("MemTotal: 65536 kB\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	rows := 0
	for _, line := range strings.Split(section, "\n") {
		cols := strings.Split(strings.Trim(line, "|"), "|")
		if !strings.HasPrefix(line, "|") || len(cols) != 5 || strings.HasPrefix(strings.TrimSpace(cols[1]), "-") ||
			strings.TrimSpace(cols[1]) == "flows conntrack holds" {
			continue
		}
		rows++
		flows := num(cols[1])
		ct := filepath.Join(dir, "nf_conntrack_max")
		if err := os.WriteFile(ct, []byte(strconv.FormatInt(flows, 10)), 0o644); err != nil {
			t.Fatal(err)
		}
		for i, v6 := range []bool{false, true} {
			s, err := sizeNATMaps(natInputs{Meminfo: meminfo, ConntrackMax: ct, IPv4: true, IPv6: v6, GoMemLimit: goMem,
				Limit: cgroupmem.Limit{Bytes: limit, File: "memory.max"}})
			if err != nil {
				t.Fatal(err)
			}
			if want := num(cols[2]); int64(s.Wanted) != want {
				t.Errorf("docs/deploy.md, %s: %d entries wanted, sizeNATMaps wants %d", strings.TrimSpace(cols[0]), want, s.Wanted)
			}
			m := cell.FindStringSubmatch(strings.TrimSpace(cols[3+i]))
			if m == nil {
				t.Fatalf("docs/deploy.md, %s: %q: want \"entries (MiB)\" or \"entries (MiB, capped)\"", strings.TrimSpace(cols[0]), cols[3+i])
			}
			gotMiB := (int64(s.Entries)*entryBytes(true, v6) + mib/2) / mib
			if num(m[1]) != int64(s.Entries) || num(m[2]) != gotMiB || (m[3] != "") != s.CappedByLimit {
				t.Errorf("docs/deploy.md, %s, IPv6 %v: %q; sizeNATMaps gives %d entries (%d MiB, capped %v)",
					strings.TrimSpace(cols[0]), v6, strings.TrimSpace(cols[3+i]), s.Entries, gotMiB, s.CappedByLimit)
			}
		}
	}
	if rows == 0 {
		t.Fatal("docs/deploy.md: no rows in the table of NAT map sizes")
	}
}
