// Package unixsock creates the agent's unix sockets (the API's and the
// shell's) with the narrowest permissions that work: the socket is mode 0600
// from the moment it appears on the filesystem, and a parent directory the
// agent has to create is mode 0700. Whoever can connect to these sockets can
// allocate addresses or inspect the agent, so only root may.
package unixsock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Mode is the permission of every socket the agent listens on.
const Mode os.FileMode = 0o600

// DirMode is the permission of a socket directory the agent creates. An
// existing directory (e.g. a hostPath the kubelet made) is left as it is.
const DirMode os.FileMode = 0o700

// Listen listens on the unix socket at path. flag names the setting the
// path came from, for errors ("--api-socket /run/x.sock: ...").
//
// A socket left by a previous run is removed, but one that another process
// still serves is not taken over: that is an error. The socket is created
// with Mode (set on the socket before bind, so that there is no window in
// which it has the umask's wider mode) and chmod'ed again after bind in
// case the kernel ignored the first.
func Listen(flag, path string) (net.Listener, error) {
	wrap := func(err error) error { return fmt.Errorf("%s %s: %w", flag, path, err) }
	if err := os.MkdirAll(filepath.Dir(path), DirMode); err != nil {
		return nil, wrap(err)
	}
	if err := removeStale(path); err != nil {
		return nil, wrap(err)
	}
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
		return nil, wrap(err)
	}
	if err := os.Chmod(path, Mode); err != nil {
		ln.Close()
		return nil, wrap(fmt.Errorf("chmod: %w", err))
	}
	return ln, nil
}

// removeStale removes a socket left by a previous run, but refuses to take
// over one that another process still serves or a path that is not a socket.
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

// ErrInUse is the error for a socket that a process still serves.
var ErrInUse = errors.New("is in use by another process (another agent running?)")

// RemoveStale removes the socket at path unless a process still serves it
// (ErrInUse) or the path is not a socket; removed is false when there was
// nothing to remove. For `ipmasq-agent uninstall`.
func RemoveStale(path string) (removed bool, err error) {
	if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err := removeStale(path); err != nil {
		return false, fmt.Errorf("%s %w", path, err)
	}
	return true, nil
}
