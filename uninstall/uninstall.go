// Package uninstall takes ipmasq off a node: `ipmasq-agent uninstall`
// (and the Job in deploy/uninstall/) detaches the datapath, removes the
// pins under <bpf-root>/ipmasq, the ip rules of ipmasq's protocol (170),
// the state files and the agent's sockets, and a reservation an older
// version made in ip_local_reserved_ports, with one line per object it
// removed (this version writes no sysctl). It refuses while an agent runs: the agent holds the state lock
// (internal/agentlock) and answers on its sockets. A second run finds
// nothing and says so.
//
// It sits with the composition root (agent) because it is the one place
// besides it that needs every owner of a kernel object or file: each
// owner says what is its (tcattach.Detach, iprules.RemoveOwned,
// ipam.IsStateFile, k8snode.StateFile), this package only runs them in
// order.
package uninstall

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/cells/k8snode"
	"github.com/ipmasq/ipmasq/internal/agentlock"
	"github.com/ipmasq/ipmasq/internal/unixsock"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/readers/shell"
	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/reconcilers/tcattach"
	"github.com/ipmasq/ipmasq/settings"
)

// Options are the paths of the agent to remove: the agent's own flags,
// with the same values.
type Options struct {
	// BPFRoot is the agent's --bpf-root; its pins are <BPFRoot>/ipmasq.
	BPFRoot string
	// StateDir is the agent's --state-dir.
	StateDir string
	// APISocket and ShellSocket are the agent's --api-socket and
	// --shell-sock-path; empty: none.
	APISocket, ShellSocket string
	// RulePriority is the agent's --egress-rule-priority, accepted so that
	// the agent's arguments can be passed as they are; rules of protocol
	// 170 are removed at every priority (nested exceptions use the ones
	// below it, and an earlier agent may have run with another).
	RulePriority uint32
	// NATPortRange is the agent's --nat-port-range: an older agent
	// reserved these ranges in ip_local_reserved_ports
	// (removeOldReservation takes them back).
	NATPortRange string
	// ReservedPortsPath is the sysctl file of the reservation
	// (ReservedPortsPath; another file in tests).
	ReservedPortsPath string
}

// DefaultOptions are the agent's defaults.
var DefaultOptions = Options{
	BPFRoot:           settings.Default.BPFRoot,
	StateDir:          settings.Default.StateDir,
	APISocket:         ipamapi.DefaultSocket,
	ShellSocket:       shell.DefaultSocket,
	RulePriority:      111,
	NATPortRange:      datapath.DefaultConfig.NATPortRange,
	ReservedPortsPath: ReservedPortsPath,
}

// Flags registers the options as the agent's flags, with o's values as
// defaults.
func (o *Options) Flags(f *pflag.FlagSet) {
	f.StringVar(&o.BPFRoot, "bpf-root", o.BPFRoot, "The agent's --bpf-root: its pins are <bpf-root>/"+settings.PinDirName)
	f.StringVar(&o.StateDir, "state-dir", o.StateDir, "The agent's --state-dir")
	f.StringVar(&o.APISocket, "api-socket", o.APISocket, "The agent's --api-socket")
	f.StringVar(&o.ShellSocket, shell.SocketFlag, o.ShellSocket, "The agent's --shell-sock-path")
	f.Uint32Var(&o.RulePriority, "egress-rule-priority", o.RulePriority,
		"The agent's --egress-rule-priority, accepted as the agent takes it: every ip rule of protocol 170 is removed, at any priority")
	f.StringVar(&o.NATPortRange, "nat-port-range", o.NATPortRange,
		"The agent's --nat-port-range: where an older ipmasq reserved one of its ranges in ip_local_reserved_ports (an item of the list exactly), the range is removed from it; nothing else of the sysctl is changed")
}

// ErrAgentRunning is returned, before anything is removed, when an agent
// holds the state lock or answers on one of its sockets.
var ErrAgentRunning = errors.New("an ipmasq-agent is running on this node; stop it first (e.g. kubectl -n kube-system delete daemonset ipmasq-agent), then run the uninstall again")

// Run removes ipmasq from the network namespace of the calling thread and
// the given paths, writing one line per object removed to w and a last
// line with the count; it returns that count. Errors do not stop it: every
// step runs, and the error joins what failed.
func Run(o Options, w io.Writer) (int, error) {
	if err := bpfmap.CheckBPFFS(o.BPFRoot); err != nil {
		return 0, err
	}
	if err := running(o); err != nil {
		return 0, err
	}
	natRanges, _, err := datapath.ParsePortRanges("--nat-port-range", o.NATPortRange)
	if err != nil {
		return 0, err
	}
	n := 0
	report := func(line string) {
		n++
		fmt.Fprintln(w, line)
	}
	note := func(line string) { fmt.Fprintln(w, line) }

	// The lock, held while removing, so that an agent started meanwhile
	// stops at once instead of pinning into a directory being emptied.
	var lock *agentlock.Lock
	lockPath := agentlock.Path(o.StateDir)
	_, statErr := os.Lstat(lockPath)
	lockExisted := statErr == nil
	if _, err := os.Stat(o.StateDir); err == nil {
		l, err := agentlock.Acquire(o.StateDir)
		if errors.Is(err, agentlock.ErrHeld) {
			return 0, fmt.Errorf("%w (%v)", ErrAgentRunning, err)
		}
		if err != nil {
			return 0, err
		}
		lock = l
	}

	var errs []error
	pinDir := filepath.Join(o.BPFRoot, settings.PinDirName)
	// Whether ipmasq was here, before its traces go: an older version's
	// reservation is recognised only then.
	_, pinErr := os.Stat(pinDir)
	_, stateErr := os.Stat(o.StateDir)
	installed := pinErr == nil || stateErr == nil
	// Programs first: detached, they no longer translate, and the maps
	// they used can go.
	errs = append(errs, tcattach.Detach(pinDir, report))
	errs = append(errs, removeTree(pinDir, "pin", report))
	errs = append(errs, iprules.RemoveOwned(report))
	errs = append(errs, removeOldReservation(cmp.Or(o.ReservedPortsPath, ReservedPortsPath), natRanges, installed, report, note))
	errs = append(errs, removeState(o.StateDir, report))
	// Releases ipmasq-cni recorded for an agent that is not coming back:
	// its endpoints went with the state files.
	errs = append(errs, removeTree(ipamapi.PendingReleaseDir(o.StateDir), "pending release", report))
	for _, sock := range []string{o.APISocket, o.ShellSocket} {
		if sock == "" {
			continue
		}
		removed, err := unixsock.RemoveStale(sock)
		if err != nil {
			errs = append(errs, err)
		}
		for _, p := range removed {
			if p == sock {
				report("removed socket " + p)
			} else {
				report("removed lock file " + p)
			}
		}
	}
	if lock != nil {
		// Removed while held: an agent that opened the file before fails
		// (the lock is taken); one that starts after creates a new file,
		// locks it and runs as on a fresh node.
		if err := os.Remove(lockPath); err == nil && lockExisted {
			report("removed lock file " + lockPath)
		}
		lock.Release()
	}
	var dirs []string
	for _, d := range []string{o.StateDir, dirOf(o.APISocket), dirOf(o.ShellSocket)} {
		if d != "" && !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	for _, d := range dirs {
		removeEmptyDir(d, report, note)
	}
	if n == 0 {
		note("uninstall: nothing of ipmasq found: nothing removed")
	} else {
		note(fmt.Sprintf("uninstall: removed %d objects of ipmasq", n))
	}
	return n, errors.Join(errs...)
}

// running says whether an agent is running: it holds the state lock, or a
// process answers on one of its sockets (an agent with another
// --state-dir).
func running(o Options) error {
	if held, err := agentlock.Held(o.StateDir); held {
		return fmt.Errorf("%w (%v)", ErrAgentRunning, err)
	} else if err != nil {
		return err
	}
	for _, s := range []struct{ flag, path string }{{"--api-socket", o.APISocket}, {"--shell-sock-path", o.ShellSocket}} {
		if s.path == "" {
			continue
		}
		// The listener's lock: its holder serves the socket, whatever a
		// dial says.
		if unixsock.Held(s.path) {
			return fmt.Errorf("%w (%s %s is held by a running agent)", ErrAgentRunning, s.flag, s.path)
		}
		if c, err := net.DialTimeout("unix", s.path, 200*time.Millisecond); err == nil {
			c.Close()
			return fmt.Errorf("%w (%s %s answers)", ErrAgentRunning, s.flag, s.path)
		}
	}
	return nil
}

// removeTree removes dir and everything under it, deepest first, reporting
// each file as a kind ("pin") and each directory.
func removeTree(dir, kind string, report func(string)) error {
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		paths = append(paths, p)
		return nil
	})
	var errs []error
	errs = append(errs, err)
	for i := len(paths) - 1; i >= 0; i-- {
		p := paths[i]
		fi, err := os.Lstat(p)
		if err != nil {
			continue
		}
		if err := os.Remove(p); err != nil {
			errs = append(errs, err)
			continue
		}
		if fi.IsDir() {
			report("removed directory " + p)
		} else {
			report("removed " + kind + " " + p)
		}
	}
	return errors.Join(errs...)
}

// removeState removes the files of dir that the agent writes: the IPAM
// store's, the Node's pod CIDRs. Other files stay.
func removeState(dir string, report func(string)) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		name := e.Name()
		if !ipam.IsStateFile(name) && name != k8snode.StateFile && name != k8snode.StateFile+".tmp" {
			continue
		}
		p := filepath.Join(dir, name)
		if err := os.Remove(p); err != nil {
			errs = append(errs, err)
			continue
		}
		report("removed state file " + p)
	}
	return errors.Join(errs...)
}

// removeEmptyDir removes a state or socket directory once it is empty. A
// mount point (a hostPath volume of the Job) stays, and the note says so;
// a directory with other files stays silently (e.g. /run).
func removeEmptyDir(dir string, report, note func(string)) {
	err := os.Remove(dir)
	switch {
	case err == nil:
		report("removed directory " + dir)
	case errors.Is(err, unix.EBUSY):
		note("kept directory " + dir + ": a mount point (empty; remove it on the node if you like)")
	}
}

func dirOf(path string) string {
	if path == "" {
		return ""
	}
	return strings.TrimSuffix(filepath.Dir(path), "/")
}
