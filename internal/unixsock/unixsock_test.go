package unixsock

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// TestListenModes: with umask 0 the socket is still 0600 and the directory
// Listen creates 0700; an existing directory keeps its mode.
func TestListenModes(t *testing.T) {
	defer syscall.Umask(syscall.Umask(0))
	dir := t.TempDir()
	path := filepath.Join(dir, "new", "x.sock")
	ln, err := Listen("--x", path, nil)
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
	ln2, err := Listen("--x", filepath.Join(dir, "y.sock"), nil)
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
	live, err := Listen("--x", path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Listen("--x", path, nil); err == nil || !strings.Contains(err.Error(), "--x "+path+": is in use by another process") {
		t.Errorf("second listener on a live socket: %v", err)
	}
	live.Close()
	// A socket file nobody serves (a killed agent's).
	staleSocket(t, path)
	ln, err := Listen("--x", path, nil)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	ln.Close()

	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen("--x", file, nil); err == nil || !strings.Contains(err.Error(), "--x "+file+": exists and is not a socket") {
		t.Errorf("listen on a regular file: %v", err)
	}
}

// staleSocket leaves a socket file at path that nobody serves.
func staleSocket(t *testing.T, path string) {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
}

// serves dials path and checks that l accepts the connection.
func serves(t *testing.T, l *Listener, path string) {
	t.Helper()
	got := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			c.Close()
		}
		got <- err
	}()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	c.Close()
	if err := <-got; err != nil {
		t.Fatalf("accept: %v", err)
	}
}

func inode(t *testing.T, path string) fileID {
	t.Helper()
	id, _, err := statID(path)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestSecondListenerLeavesTheSocket: a second listener on a path that one
// serves (another agent on the same --api-socket, whatever its
// --state-dir) fails on the path's lock, naming the holder, without
// removing or replacing the first's socket, even when the first does not
// answer a dial in time (the check the lock replaces could be fooled by a
// full backlog or a slow machine into removing a live socket).
func TestSecondListenerLeavesTheSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "api.sock")
	first, err := Listen("--api-socket", path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	before := inode(t, path)
	for range 3 {
		_, err := Listen("--api-socket", path, nil)
		if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "(pid "+strconv.Itoa(os.Getpid())+")") {
			t.Fatalf("second listener: %v, want ErrInUse naming the holder", err)
		}
	}
	if got := inode(t, path); got != before {
		t.Fatalf("the second listener replaced the first's socket (%v -> %v)", before, got)
	}
	serves(t, first, path)
}

// TestCloseLeavesAnotherSocket: closing removes the socket file only while
// it is the listener's own: one another process has put at the path since
// stays (before, a stopping agent removed whatever was at its path).
func TestCloseLeavesAnotherSocket(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "api.sock")
	var mu sync.Mutex
	var events []error
	l, err := Listen("--api-socket", path, func(_ string, err error) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, err)
	})
	if err != nil {
		t.Fatal(err)
	}
	// Another socket renamed over the path (atomically: the listener's
	// check never sees it missing).
	other, err := net.Listen("unix", filepath.Join(dir, "other.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := os.Rename(filepath.Join(dir, "other.sock"), path); err != nil {
		t.Fatal(err)
	}
	otherID := inode(t, path)
	l.Check()
	mu.Lock()
	defer mu.Unlock()
	if len(events) == 0 || events[0] == nil || !strings.Contains(events[0].Error(), "replaced by another file") {
		t.Fatalf("check of a replaced socket: events %v", events)
	}
	mu.Unlock()
	l.Close()
	mu.Lock()
	if got := inode(t, path); got != otherID {
		t.Fatalf("Close removed or replaced the other process's socket")
	}
	// Its own socket goes at Close.
	os.Remove(path)
	l2, err := Listen("--api-socket", path, nil)
	if err != nil {
		t.Fatal(err)
	}
	l2.Close()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("own socket after Close: %v", err)
	}
}

// TestRebindWhenRemoved: a socket file removed under the listener (an
// uninstall or cleanup of another process) is bound again, reported, and
// served; the connections of the new socket reach the same Accept.
func TestRebindWhenRemoved(t *testing.T) {
	path := filepath.Join(t.TempDir(), "api.sock")
	events := make(chan string, 4)
	l, err := Listen("--api-socket", path, func(msg string, err error) {
		if err != nil {
			msg = "error: " + err.Error()
		}
		events <- msg
	})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	serves(t, l, path)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	// The watcher's own check (every CheckInterval) binds it again.
	if msg := <-events; !strings.Contains(msg, "removed by another process; bound again") {
		t.Fatalf("event %q", msg)
	}
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode() != os.ModeSocket|Mode {
		t.Fatalf("socket after rebind: %v %v", fi, err)
	}
	serves(t, l, path)
}

// TestDirRemovedUnderTheListener: the socket's directory removed as a
// whole while the listener still reaches it at its path, as an agent in a
// container does after `rm -rf /run/ipmasq` on the node (its hostPath
// mount still shows the removed directory). Binding again there cannot
// work and nothing would ever reach the socket: the listener says so once,
// with ErrDirRemoved, instead of failing to bind every second. The
// container's view is made here by a /proc/self/fd link to the directory,
// which resolves to the removed directory as the bind mount does.
func TestDirRemovedUnderTheListener(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ipmasq")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	path := "/proc/self/fd/" + strconv.Itoa(int(d.Fd())) + "/api.sock"
	events := make(chan error, 4)
	l, err := Listen("--api-socket", path, func(msg string, err error) { events <- err })
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	serves(t, l, path)
	if _, err := os.Lstat(filepath.Join(dir, "api.sock")); err != nil {
		t.Fatalf("the socket at the directory's own path: %v", err)
	}
	// The node's cleanup: the directory and everything in it.
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := <-events; !errors.Is(err, ErrDirRemoved) {
		t.Fatalf("event %v, want ErrDirRemoved", err)
	}
	// Once: later checks report nothing more.
	l.Check()
	l.Check()
	select {
	case err := <-events:
		t.Fatalf("a second event: %v", err)
	default:
	}
}

// TestRemoveStaleRefusesALiveSocket: the uninstall's removal leaves a
// socket whose listener holds the lock, even when the dial fails; after
// the listener is gone it removes the lock file too.
func TestRemoveStaleRefusesALiveSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "api.sock")
	l, err := Listen("--api-socket", path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !Held(path) {
		t.Fatal("Held: false while listening")
	}
	before := inode(t, path)
	if removed, err := RemoveStale(path); !errors.Is(err, ErrInUse) || len(removed) != 0 {
		t.Fatalf("RemoveStale of a live socket: %v %v", removed, err)
	}
	if inode(t, path) != before {
		t.Fatal("RemoveStale touched a live socket")
	}
	serves(t, l, path)
	l.Close()
	if Held(path) {
		t.Fatal("Held: true after Close")
	}
	staleSocket(t, path)
	removed, err := RemoveStale(path)
	if err != nil || len(removed) != 2 || removed[0] != path || removed[1] != path+LockSuffix {
		t.Fatalf("RemoveStale after Close: %v %v", removed, err)
	}
	if removed, err := RemoveStale(path); err != nil || len(removed) != 0 {
		t.Fatalf("second RemoveStale: %v %v", removed, err)
	}
}
