package ipamapi

import (
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"
)

// Pending releases: a CNI DEL that cannot reach the agent (restarting,
// stopped, its DaemonSet deleted) must still succeed, or the pod sticks in
// Terminating. The plugin writes the owner into a file of the agent's
// state directory instead, and the agent releases the owner's addresses
// from it: at start, before it serves any allocation, and while it runs.
// Until then the addresses stay allocated, so none is handed out while its
// release is pending; the release is by owner, so a record read twice, or
// late, frees nothing that another owner holds.

// DefaultStateDir is the agent's --state-dir default (and the DaemonSet's).
const DefaultStateDir = "/var/lib/ipmasq"

// PendingReleaseDirName is the directory of pending releases in the
// agent's --state-dir.
const PendingReleaseDirName = "pending-release"

// AgentLockName is the file a running agent locks in its --state-dir
// (internal/agentlock.FileName). Its presence says an agent was installed
// with that state directory and not uninstalled since: only then is a
// release recorded for it.
const AgentLockName = "agent.lock"

// pendingPrefix starts every record's name ("." and ".." cannot be one).
const pendingPrefix = "owner-"

// PendingReleaseDir is the directory of pending releases of stateDir.
func PendingReleaseDir(stateDir string) string {
	return filepath.Join(stateDir, PendingReleaseDirName)
}

// PendingReleaseFile is the record of owner in dir.
func PendingReleaseFile(dir, owner string) string {
	return filepath.Join(dir, pendingPrefix+url.PathEscape(owner))
}

// ErrNoAgentState is returned by WritePendingRelease when stateDir holds no
// agent (never installed there, or uninstalled): there is nothing to
// release.
var ErrNoAgentState = errors.New("no ipmasq-agent state")

// WritePendingRelease records that owner's addresses are to be released
// by the agent of stateDir. The record is durable before it returns
// (written to a temporary file, synced, renamed, directory synced); writing
// it again is harmless.
func WritePendingRelease(stateDir, owner string) error {
	if _, err := os.Lstat(filepath.Join(stateDir, AgentLockName)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%s: %w", stateDir, ErrNoAgentState)
		}
		return err
	}
	dir := PendingReleaseDir(stateDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	path := PendingReleaseFile(dir, owner)
	tmp, err := os.CreateTemp(dir, ".tmp-")
	if err != nil {
		return err
	}
	_, err = tmp.WriteString(owner + "\n")
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("record the release of %s in %s: %w", owner, dir, err)
	}
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// PendingRelease is one recorded release.
type PendingRelease struct {
	// Owner whose addresses are to be released.
	Owner string
	// Path of the record; remove it once the release is done.
	Path string
}

// PendingReleases lists the records of stateDir; a missing directory is
// none. A record whose content does not match its name (torn, or not
// ours) is returned as an error and left alone.
func PendingReleases(stateDir string) ([]PendingRelease, error) {
	dir := PendingReleaseDir(stateDir)
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []PendingRelease
	var errs []error
	for _, e := range entries {
		name, ok := strings.CutPrefix(e.Name(), pendingPrefix)
		if !ok || !e.Type().IsRegular() {
			continue
		}
		path := filepath.Join(dir, e.Name())
		owner, err := url.PathUnescape(name)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: not a pending release record: %w", path, err))
			continue
		}
		b, err := os.ReadFile(path)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if strings.TrimSuffix(string(b), "\n") != owner {
			errs = append(errs, fmt.Errorf("%s: holds %q, not its owner %q", path, b, owner))
			continue
		}
		out = append(out, PendingRelease{Owner: owner, Path: path})
	}
	return out, errors.Join(errs...)
}
