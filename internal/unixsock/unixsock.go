// Package unixsock creates the agent's unix sockets (the API's and the
// shell's) with the narrowest permissions that work: the socket is mode 0600
// from the moment it appears on the filesystem, and a parent directory the
// agent has to create is mode 0700. Whoever can connect to these sockets can
// allocate addresses or inspect the agent, so only root may.
//
// A listener owns its path: it holds an flock on <path>.lock for its whole
// life, so a second listener (another agent, whatever its --state-dir) and
// the uninstall leave a live socket alone instead of deciding by a dial
// that can race a bind; it removes the path at close only while the path is
// still its own socket; and it binds again when its socket file is removed
// under it. When the socket's directory itself was removed while the
// listener still reaches it (a bind mount, e.g. a hostPath volume, whose
// source directory was deleted on the host), no socket it binds there can
// be reached by anyone else again: it reports ErrDirRemoved once, for its
// owner to restart (the runtime then mounts the host's directory anew).
package unixsock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Mode is the permission of every socket the agent listens on.
const Mode os.FileMode = 0o600

// DirMode is the permission of a socket directory the agent creates. An
// existing directory (e.g. a hostPath the kubelet made) is left as it is.
const DirMode os.FileMode = 0o700

// LockSuffix is appended to a socket's path for its lock file.
const LockSuffix = ".lock"

// CheckInterval is how often a listener checks that its socket file is
// still there.
const CheckInterval = time.Second

// ErrInUse is the error for a socket that a process still serves.
var ErrInUse = errors.New("is in use by another process (another agent running?)")

// ErrDirRemoved is reported when the socket's directory was removed while
// the listener runs, and the listener still sees the removed directory at
// its path: a bind mount of a directory deleted at its source (in
// Kubernetes, the hostPath directory removed on the node, e.g. by `rm -rf
// /run/ipmasq`). Nothing bound there can be reached from the host again;
// a restart is the remedy (the container runtime creates a missing
// hostPath directory when it starts the container).
var ErrDirRemoved = errors.New("its directory was removed on the host while the agent serves it, and this process still sees the removed one (a bind mount such as a hostPath volume): no socket bound there can be reached; restart the agent (the container runtime makes the directory again)")

// Listener is a unix socket listener that owns its path (see the package
// doc). It is a net.Listener.
type Listener struct {
	flag, path string
	lock       *os.File
	onEvent    func(msg string, err error)

	conns chan net.Conn
	done  chan struct{}
	wg    sync.WaitGroup

	mu     sync.Mutex
	cur    *net.UnixListener
	id     fileID
	closed bool
	// dirGone is set once ErrDirRemoved was reported: checking on cannot
	// bring the socket back.
	dirGone bool
}

// fileID identifies a file across renames and re-creations.
type fileID struct{ dev, ino uint64 }

func statID(path string) (fileID, os.FileInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return fileID{}, nil, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fileID{}, fi, errors.New("no inode")
	}
	return fileID{dev: uint64(st.Dev), ino: st.Ino}, fi, nil
}

// Listen listens on the unix socket at path. flag names the setting the
// path came from, for errors ("--api-socket /run/x.sock: ...").
//
// A socket left by a previous run is removed, but one that another process
// still serves is not taken over: that is an error (ErrInUse), and the
// path is not touched. The socket is created with Mode (set on the socket
// before bind, so that there is no window in which it has the umask's
// wider mode) and chmod'ed again after bind in case the kernel ignored
// the first.
//
// onEvent, when not nil, hears of a socket file that vanished and was
// bound again (err nil), or that could not be (err set).
func Listen(flag, path string, onEvent func(msg string, err error)) (*Listener, error) {
	wrap := func(err error) error { return fmt.Errorf("%s %s: %w", flag, path, err) }
	if err := os.MkdirAll(filepath.Dir(path), DirMode); err != nil {
		return nil, wrap(err)
	}
	lock, err := lockPath(path)
	if err != nil {
		return nil, wrap(err)
	}
	// The path is this listener's from here: nothing else that takes the
	// lock removes or binds it.
	if err := removeStale(path); err != nil {
		lock.Close()
		return nil, wrap(err)
	}
	l := &Listener{flag: flag, path: path, lock: lock, onEvent: onEvent, conns: make(chan net.Conn), done: make(chan struct{})}
	ul, id, err := bind(path)
	if err != nil {
		lock.Close()
		return nil, wrap(err)
	}
	l.cur, l.id = ul, id
	l.wg.Add(2)
	go l.acceptFrom(ul)
	go l.watch()
	return l, nil
}

// lockPath takes the flock of path's lock file without waiting; the error
// wraps ErrInUse and names the holder's pid when another process has it.
func lockPath(path string) (*os.File, error) {
	lp := path + LockSuffix
	f, err := os.OpenFile(lp, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w%s (it holds %s)", ErrInUse, holder(lp), lp)
		}
		return nil, fmt.Errorf("lock %s: %w", lp, err)
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

// holder is " (pid N)" from a lock file, or "".
func holder(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return ""
	}
	return " (pid " + strconv.Itoa(pid) + ")"
}

// bind creates the socket file at path with Mode. Closing the returned
// listener never unlinks the path: Close decides that, by inode.
func bind(path string) (*net.UnixListener, fileID, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var ferr error
		// Linux gives the bound socket file the socket inode's mode
		// (masked by the umask), so set it before bind.
		if err := c.Control(func(fd uintptr) { ferr = unix.Fchmod(int(fd), uint32(Mode)) }); err != nil {
			return err
		}
		return ferr
	}}
	ln, err := lc.Listen(context.Background(), "unix", path)
	if err != nil {
		return nil, fileID{}, err
	}
	ul := ln.(*net.UnixListener)
	ul.SetUnlinkOnClose(false)
	if err := os.Chmod(path, Mode); err != nil {
		ul.Close()
		os.Remove(path)
		return nil, fileID{}, fmt.Errorf("chmod: %w", err)
	}
	id, _, err := statID(path)
	if err != nil {
		ul.Close()
		return nil, fileID{}, err
	}
	return ul, id, nil
}

// removeStale removes a socket left by a previous run, but refuses to take
// over one that another process still serves (an agent of a version that
// took no lock) or a path that is not a socket.
func removeStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return errors.New("exists and is not a socket")
	}
	if c, err := net.DialTimeout("unix", path, 200*time.Millisecond); err == nil {
		c.Close()
		return ErrInUse
	}
	return os.Remove(path)
}

// acceptFrom hands the connections of one bound socket to Accept until the
// listener closes or that socket is replaced.
func (l *Listener) acceptFrom(ul *net.UnixListener) {
	defer l.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		c, err := ul.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE and the like: wait, as net/http does.
			select {
			case <-l.done:
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		select {
		case l.conns <- c:
		case <-l.done:
			c.Close()
			return
		}
	}
}

// Accept implements net.Listener.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Addr implements net.Listener.
func (l *Listener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

// Close stops accepting, removes the socket file if it is still this
// listener's own (never one another process made at the path since), and
// gives up the path's lock.
func (l *Listener) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.done)
	err := l.cur.Close()
	if id, _, serr := statID(l.path); serr == nil && id == l.id {
		os.Remove(l.path)
	}
	l.mu.Unlock()
	l.wg.Wait()
	// The lock file stays: removing it while another process waits to
	// open it would let two processes lock two files of one name.
	l.lock.Close()
	return err
}

// watch binds again when the socket file is removed under the listener.
func (l *Listener) watch() {
	defer l.wg.Done()
	t := time.NewTicker(CheckInterval)
	defer t.Stop()
	for {
		select {
		case <-l.done:
			return
		case <-t.C:
			l.Check()
		}
	}
}

// Check makes sure the socket file at the path is this listener's: when
// it is gone it binds the path again (the lock says no one else may). A
// path now holding something else is left alone and reported. A directory
// removed under a bind mount is reported once (ErrDirRemoved), and then
// no longer checked.
func (l *Listener) Check() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.dirGone {
		return
	}
	id, fi, err := statID(l.path)
	switch {
	case err == nil && id == l.id:
		return
	case err == nil:
		l.event("", fmt.Errorf("%s %s: replaced by another file (%s) while this agent serves it; not taking it over: the socket is unreachable", l.flag, l.path, fi.Mode().Type()))
		return
	case !errors.Is(err, os.ErrNotExist):
		l.event("", fmt.Errorf("%s %s: %w", l.flag, l.path, err))
		return
	}
	// A directory that is gone from every path but this process's view:
	// binding in it would fail (ENOENT), and making it again is not
	// possible from here (MkdirAll finds it).
	if dirRemoved(filepath.Dir(l.path)) {
		l.dirGone = true
		l.event("", fmt.Errorf("%s %s: %w", l.flag, l.path, ErrDirRemoved))
		return
	}
	if err := os.MkdirAll(filepath.Dir(l.path), DirMode); err != nil {
		l.event("", fmt.Errorf("%s %s: removed under the agent, and its directory cannot be made again: %w", l.flag, l.path, err))
		return
	}
	ul, nid, err := bind(l.path)
	if err != nil {
		l.event("", fmt.Errorf("%s %s: removed under the agent, and binding it again failed: %w", l.flag, l.path, err))
		return
	}
	old := l.cur
	l.cur, l.id = ul, nid
	l.wg.Add(1)
	go l.acceptFrom(ul)
	old.Close()
	l.event(l.flag+" "+l.path+": the socket file was removed by another process; bound again", nil)
}

// dirRemoved reports whether dir is a directory that was removed (no link
// left) yet is still reached at this path: the root of a bind mount whose
// source was deleted, or a /proc/<pid>/fd link to a removed directory.
func dirRemoved(dir string) bool {
	fi, err := os.Stat(dir)
	if err != nil || !fi.IsDir() {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && st.Nlink == 0
}

func (l *Listener) event(msg string, err error) {
	if l.onEvent != nil {
		l.onEvent(msg, err)
	}
}

// RemoveStale removes the socket at path, and its lock file, unless a
// process still serves it (ErrInUse: it holds the lock, or answers) or the
// path is not a socket. It returns the paths it removed. For
// `ipmasq-agent uninstall`.
func RemoveStale(path string) (removed []string, err error) {
	lp := path + LockSuffix
	_, sockErr := os.Lstat(path)
	_, lockErr := os.Lstat(lp)
	if errors.Is(sockErr, os.ErrNotExist) && errors.Is(lockErr, os.ErrNotExist) {
		return nil, nil
	}
	lock, err := lockPath(path)
	if err != nil {
		return nil, fmt.Errorf("%s %w", path, err)
	}
	defer lock.Close()
	if sockErr == nil {
		if err := removeStale(path); err != nil {
			return nil, fmt.Errorf("%s %w", path, err)
		}
		removed = append(removed, path)
	}
	// Removed while held (see Close for why a listener never does this):
	// a listener that opened the file before fails on the lock, one that
	// starts after makes a new file.
	if err := os.Remove(lp); err == nil {
		removed = append(removed, lp)
	}
	return removed, nil
}

// Held reports whether a listener holds the lock of the socket at path.
func Held(path string) bool {
	f, err := os.Open(path + LockSuffix)
	if err != nil {
		return false
	}
	defer f.Close()
	return errors.Is(unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB), unix.EWOULDBLOCK)
}
