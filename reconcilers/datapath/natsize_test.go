package datapath

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
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

	s, err := sizeNATMaps(0, meminfo, ctMax)
	if err != nil || s.Entries != 2<<20 || s.Configured {
		t.Errorf("24 GiB, nf_conntrack_max 1048576: %+v %v, want 2097152 entries", s, err)
	}
	if !strings.Contains(s.String(), "nf_conntrack_max 1048576") {
		t.Errorf("log line %q does not say where the size comes from", s)
	}
	if s, err := sizeNATMaps(0, small, noCT); err != nil || s.Entries != 16384 {
		t.Errorf("1 GiB, no conntrack: %+v %v, want 16384 entries", s, err)
	}
	// A configured size is kept, even one far below the node's conntrack.
	for _, n := range []uint32{64, 131072, 1 << 22} {
		if s, err := sizeNATMaps(n, meminfo, ctMax); err != nil || s.Entries != n || !s.Configured {
			t.Errorf("--nat-max-entries=%d: %+v %v", n, s, err)
		}
		if s, err := sizeNATMaps(n, noCT, noCT); err != nil || s.Entries != n {
			t.Errorf("--nat-max-entries=%d without /proc files: %+v %v", n, s, err)
		}
	}
	// Unreadable input is an error that names the file.
	bad := write("bad-ct", "lots\n")
	if _, err := sizeNATMaps(0, meminfo, bad); err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("bad nf_conntrack_max: %v", err)
	}
	if _, err := sizeNATMaps(0, write("no-total", "MemFree: 1 kB\n"), ctMax); err == nil || !strings.Contains(err.Error(), "MemTotal") {
		t.Errorf("meminfo without MemTotal: %v", err)
	}
}

// TestDisabledFamilyNATMapIsSmall: a disabled family's NAT map is
// disabledFamilyNATEntries, whatever the node or --nat-max-entries says,
// and the log line says why; the enabled family keeps its size.
func TestDisabledFamilyNATMapIsSmall(t *testing.T) {
	s := natSizing{Entries: 524288}
	if v4, v6 := s.forFamilies(true, true).V4(), s.forFamilies(true, true).V6(); v4 != 524288 || v6 != 524288 {
		t.Errorf("both families: nat_v4 %d, nat_v6 %d, want 524288 each", v4, v6)
	}
	v4only := s.forFamilies(true, false)
	if v4only.V4() != 524288 || v4only.V6() != disabledFamilyNATEntries {
		t.Errorf("IPv6 disabled: nat_v4 %d, nat_v6 %d, want 524288 and %d", v4only.V4(), v4only.V6(), disabledFamilyNATEntries)
	}
	if !strings.Contains(v4only.String(), "nat_v6 has 1024 (--enable-ipv6=false") {
		t.Errorf("log line %q does not say nat_v6 is small and why", v4only)
	}
	v6only := natSizing{Entries: 64, Configured: true}.forFamilies(false, true)
	if v6only.V4() != disabledFamilyNATEntries || v6only.V6() != 64 {
		t.Errorf("IPv4 disabled, --nat-max-entries=64: nat_v4 %d, nat_v6 %d", v6only.V4(), v6only.V6())
	}
}
