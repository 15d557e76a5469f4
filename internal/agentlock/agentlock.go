// Package agentlock is the lock a running agent holds on its state
// directory: an flock on <state-dir>/agent.lock, taken at start and held
// until the process ends (the kernel drops it even on SIGKILL). It keeps
// two agents off one node's state, and lets `ipmasq-agent uninstall` tell
// a running agent from one that is gone. It is a leaf: it imports nothing
// of the module.
package agentlock

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// FileName is the lock file's name in the state directory.
const FileName = "agent.lock"

// ErrHeld is returned when another process holds the lock.
var ErrHeld = errors.New("held by another process")

// Lock is a held lock; Release gives it up.
type Lock struct {
	f *os.File
}

// Path is the lock file of a state directory.
func Path(stateDir string) string { return filepath.Join(stateDir, FileName) }

// Acquire takes the lock of stateDir without waiting, creating the
// directory (0700, like the state the agent keeps there) and the file when
// missing, and writes the holder's pid into the file for the error of the
// next one to try. When another process holds it, the error wraps ErrHeld
// and names that process's pid.
func Acquire(stateDir string) (*Lock, error) {
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return nil, err
	}
	path := Path(stateDir)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%s: %w%s", path, ErrHeld, holder(path))
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &Lock{f: f}, nil
}

// Held reports whether a process holds the lock of stateDir, without
// taking it or creating anything; the error names the holder's pid when
// it is known.
func Held(stateDir string) (bool, error) {
	path := Path(stateDir)
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return true, fmt.Errorf("%s: %w%s", path, ErrHeld, holder(path))
		}
		return false, fmt.Errorf("lock %s: %w", path, err)
	}
	return false, nil
}

// holder is ", pid N" from the lock file, or "" when it holds none.
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

// Release gives the lock up. The file stays: removing it while another
// process waits to open it would let two processes lock two different
// files of one name.
func (l *Lock) Release() error {
	return l.f.Close()
}
