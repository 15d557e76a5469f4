package unixsock

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestListenModes: with umask 0 the socket is still 0600 and the directory
// Listen creates 0700; an existing directory keeps its mode.
func TestListenModes(t *testing.T) {
	defer syscall.Umask(syscall.Umask(0))
	dir := t.TempDir()
	path := filepath.Join(dir, "new", "x.sock")
	ln, err := Listen("--x", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for p, want := range map[string]os.FileMode{path: os.ModeSocket | Mode, filepath.Dir(path): os.ModeDir | DirMode} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode() != want {
			t.Errorf("%s: mode %s, want %s", p, fi.Mode(), want)
		}
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ln2, err := Listen("--x", filepath.Join(dir, "y.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln2.Close()
	if fi, _ := os.Stat(dir); fi.Mode().Perm() != 0o755 {
		t.Errorf("existing directory changed to %s", fi.Mode())
	}
}

// TestListenStaleAndLive: a socket nobody serves is replaced; one another
// process serves, or a path that is not a socket, is an error naming flag
// and path.
func TestListenStaleAndLive(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "x.sock")
	live, err := Listen("--x", path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Listen("--x", path); err == nil || !strings.Contains(err.Error(), "--x "+path+": is in use by another process") {
		t.Errorf("second listener on a live socket: %v", err)
	}
	// Closing a unix listener removes its file; leave a stale one instead.
	live.(*net.UnixListener).SetUnlinkOnClose(false)
	live.Close()
	ln, err := Listen("--x", path)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	ln.Close()

	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen("--x", file); err == nil || !strings.Contains(err.Error(), "--x "+file+": exists and is not a socket") {
		t.Errorf("listen on a regular file: %v", err)
	}
}
