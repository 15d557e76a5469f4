package config

import (
	"context"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

func symlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

func mustWrite(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestConfigPathEntries: the entries of the directory a config path
// resolves through, for each way operators and the kubelet lay it out.
func TestConfigPathEntries(t *testing.T) {
	cases := []struct {
		name  string
		setup func(t *testing.T, dir string)
		want  []string
	}{
		{"regular file", func(t *testing.T, dir string) {
			mustWrite(t, filepath.Join(dir, "ip-masq-agent"), "")
		}, []string{"ip-masq-agent"}},
		{"absent", func(t *testing.T, dir string) {}, []string{"ip-masq-agent"}},
		{"symlink to a file in the same directory", func(t *testing.T, dir string) {
			mustWrite(t, filepath.Join(dir, "real.yaml"), "")
			symlink(t, "real.yaml", filepath.Join(dir, "ip-masq-agent"))
		}, []string{"ip-masq-agent", "real.yaml"}},
		{"absolute symlink chain in the same directory", func(t *testing.T, dir string) {
			mustWrite(t, filepath.Join(dir, "real.yaml"), "")
			symlink(t, filepath.Join(dir, "real.yaml"), filepath.Join(dir, "middle"))
			symlink(t, "middle", filepath.Join(dir, "ip-masq-agent"))
		}, []string{"ip-masq-agent", "middle", "real.yaml"}},
		{"kubernetes ConfigMap volume", func(t *testing.T, dir string) {
			ts := filepath.Join(dir, "..2026_11_30_15_00_00.1")
			if err := os.Mkdir(ts, 0o755); err != nil {
				t.Fatal(err)
			}
			mustWrite(t, filepath.Join(ts, "ip-masq-agent"), "")
			symlink(t, filepath.Base(ts), filepath.Join(dir, "..data"))
			symlink(t, "..data/ip-masq-agent", filepath.Join(dir, "ip-masq-agent"))
			mustWrite(t, filepath.Join(dir, "..data_tmp"), "") // the kubelet's next link, not yet in use
		}, []string{"ip-masq-agent", "..data", "..2026_11_30_15_00_00.1"}},
		{"absolute symlink through the directory's real path", func(t *testing.T, dir string) {
			// dir is reached through a symlink (as /etc/config → /var/config);
			// the file links to its target by the real path.
			real := t.TempDir()
			mustWrite(t, filepath.Join(real, "real.yaml"), "")
			if err := os.Remove(dir); err != nil {
				t.Fatal(err)
			}
			symlink(t, real, dir)
			symlink(t, filepath.Join(real, "real.yaml"), filepath.Join(dir, "ip-masq-agent"))
		}, []string{"ip-masq-agent", "real.yaml"}},
		{"symlink out of the directory", func(t *testing.T, dir string) {
			other := t.TempDir()
			mustWrite(t, filepath.Join(other, "real.yaml"), "")
			symlink(t, filepath.Join(other, "real.yaml"), filepath.Join(dir, "ip-masq-agent"))
		}, []string{"ip-masq-agent"}},
		{"symlink loop", func(t *testing.T, dir string) {
			symlink(t, "b", filepath.Join(dir, "ip-masq-agent"))
			symlink(t, "ip-masq-agent", filepath.Join(dir, "b"))
		}, []string{"ip-masq-agent", "b"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "config")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			tc.setup(t, dir)
			mustWrite(t, filepath.Join(dir, "unrelated"), "")
			got := slices.Sorted(maps.Keys(configPathEntries(dir, "ip-masq-agent")))
			want := slices.Sorted(slices.Values(tc.want))
			if !slices.Equal(got, want) {
				t.Fatalf("got %q, want %q", got, want)
			}
		})
	}
}

// TestWatcherIgnoresOtherEntries: an editor's temporary file being created
// and written does not signal a change; its rename over the config does.
func TestWatcherIgnoresOtherEntries(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ip-masq-agent")
	w, err := newDirWatcher(slog.New(slog.DiscardHandler), path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	// Arming signals once; drain it.
	select {
	case <-w.Changed():
	default:
	}

	tmp := filepath.Join(dir, ".ip-masq-agent.swp")
	mustWrite(t, tmp, hostileGood) // create + write + close
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.Changed():
	case <-time.After(5 * time.Second):
		t.Fatal("no change signalled for the rename over the config")
	}
	// Events arrive in order: the temporary file's came before the
	// rename's signal.
	if n := w.ignored.Load(); n < 2 {
		t.Fatalf("%d events of the temporary file ignored, want at least its create and write", n)
	}
}

// TestLoaderFollowsSymlinkedConfig: with events of other files ignored, a
// config that is a symlink still follows in-place edits of its target in
// the same directory, and ConfigMap updates (..data swaps).
func TestLoaderFollowsSymlinkedConfig(t *testing.T) {
	prefixes := func(hh *hostileHive) []netip.Prefix {
		var out []netip.Prefix
		for row := range hh.cidrs.All(hh.db.ReadTxn()) {
			out = append(out, row.Prefix)
		}
		return out
	}
	waitFor := func(t *testing.T, hh *hostileHive, want string) {
		t.Helper()
		w := netip.MustParsePrefix(want)
		deadline := time.Now().Add(5 * time.Second)
		for !slices.Equal(prefixes(hh), []netip.Prefix{w}) {
			if time.Now().After(deadline) {
				t.Fatalf("table holds %v, want [%v]", prefixes(hh), w)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	config := func(prefix string) string {
		return "nonMasqueradeCIDRs: [" + prefix + "]\nmasqLinkLocal: true\nmasqLinkLocalIPv6: true\n"
	}

	t.Run("symlink to a file in the same directory", func(t *testing.T) {
		dir := t.TempDir()
		path := filepath.Join(dir, "ip-masq-agent")
		real := filepath.Join(dir, "real.yaml")
		mustWrite(t, real, config("10.0.0.0/8"))
		symlink(t, "real.yaml", path)
		hh := startHostileHive(t, path, false)
		waitFor(t, hh, "10.0.0.0/8")
		mustWrite(t, real, config("172.16.0.0/12")) // in place
		waitFor(t, hh, "172.16.0.0/12")
		hostileWrite(t, real, []byte(config("192.168.0.0/16"))) // rename over the target
		waitFor(t, hh, "192.168.0.0/16")
	})

	t.Run("ConfigMap volume", func(t *testing.T) {
		dir := t.TempDir()
		path := filepath.Join(dir, "ip-masq-agent")
		update := func(i int, content string) {
			ts := filepath.Join(dir, "..ts_"+strconv.Itoa(i))
			if err := os.Mkdir(ts, 0o755); err != nil {
				t.Fatal(err)
			}
			mustWrite(t, filepath.Join(ts, "ip-masq-agent"), content)
			old, _ := os.Readlink(filepath.Join(dir, "..data"))
			symlink(t, filepath.Base(ts), filepath.Join(dir, "..data_tmp"))
			if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Lstat(path); err != nil {
				symlink(t, "..data/ip-masq-agent", path)
			}
			if old != "" {
				if err := os.RemoveAll(filepath.Join(dir, old)); err != nil {
					t.Fatal(err)
				}
			}
		}
		update(1, config("10.0.0.0/8"))
		hh := startHostileHive(t, path, false)
		waitFor(t, hh, "10.0.0.0/8")
		for i, p := range []string{"172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"} {
			update(i+2, config(p))
			waitFor(t, hh, p)
		}
		st := hh.waitStatus(t, "the last update", func(st *tables.ConfigStatus) bool { return st.LastError == "" })
		if st.Origin != tables.ConfigOriginFile {
			t.Fatalf("config source %s, want file", st.Origin)
		}
	})
}
