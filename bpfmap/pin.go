package bpfmap

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// OpenPinned opens the map pinned at filepath.Join(dir, spec.Name), creating
// dir and the map if needed.
//
// A pinned map whose type, key size, value size, max entries or flags differ
// from spec is replaced (unpinned and recreated) and a Warn log line says so,
// naming the path and the old and new layout: a program built for the new
// layout could not use the old map, and its contents would not fit anyway.
// A compatible map is reused as is, contents included, so that a restart
// does not disturb the datapath.
//
// spec.Pinning is ignored; the map is always pinned at the path above.
// Errors are wrapped with the operation and path ("open pinned map /x/y: ...").
func OpenPinned(log *slog.Logger, dir string, spec *ebpf.MapSpec) (*ebpf.Map, error) {
	return openPinned(log, dir, spec, false)
}

// OpenPinnedKeep is OpenPinned for state that must survive a layout change
// of the map (NAT pairs when the map is resized): when the old map's keys
// have the size of spec's and its values the size of spec's or less, its
// entries are copied into the replacement before the replacement is pinned
// in its place; a shorter value is copied as the start of the new one, the
// rest zero (a value layout may only grow by fields appended at its end,
// whose zero means "not known yet"). Entries that do not fit (a smaller
// map) are dropped and counted in the log line.
func OpenPinnedKeep(log *slog.Logger, dir string, spec *ebpf.MapSpec) (*ebpf.Map, error) {
	return openPinned(log, dir, spec, true)
}

func openPinned(log *slog.Logger, dir string, spec *ebpf.MapSpec, keep bool) (*ebpf.Map, error) {
	if log == nil {
		log = slog.Default()
	}
	path := filepath.Join(dir, spec.Name)
	wrap := func(err error) error { return fmt.Errorf("open pinned map %s: %w", path, err) }

	if spec.Name == "" {
		return nil, wrap(errors.New("map spec has no name"))
	}
	if err := rootOnlyDir(dir); err != nil {
		return nil, wrap(err)
	}

	old, err := ebpf.LoadPinnedMap(path, nil)
	switch {
	case err == nil:
		cerr := spec.Compatible(old)
		if cerr == nil {
			if err := rootOnly(path, PinMode); err != nil {
				old.Close()
				return nil, wrap(err)
			}
			return old, nil
		}
		if !errors.Is(cerr, ebpf.ErrMapIncompatible) {
			old.Close()
			return nil, wrap(cerr)
		}
		defer old.Close()
	case errors.Is(err, os.ErrNotExist):
		old = nil
	default:
		return nil, wrap(err)
	}

	create := spec.Copy()
	create.Pinning = ebpf.PinNone
	m, err := ebpf.NewMap(create)
	if err != nil {
		return nil, wrap(fmt.Errorf("create: %w", err))
	}

	// Create the replacement before unpinning the old map, so that a failure
	// to create leaves the old map where it was.
	if old != nil {
		layouts := []any{"path", path,
			"old", layoutOf(old.Type(), old.KeySize(), old.ValueSize(), old.MaxEntries(), old.Flags()),
			"new", layoutOf(spec.Type, spec.KeySize, spec.ValueSize, spec.MaxEntries, spec.Flags)}
		if keep && old.KeySize() == spec.KeySize && old.ValueSize() <= spec.ValueSize {
			copied, dropped := copyEntries(old, m)
			log.Warn("Replacing pinned BPF map with another layout; its entries are copied",
				append(layouts, "copied", copied, "dropped", dropped)...)
		} else {
			log.Warn("Replacing pinned BPF map with an incompatible layout; its entries are dropped", layouts...)
		}
		if err := old.Unpin(); err != nil {
			m.Close()
			return nil, wrap(fmt.Errorf("unpin old map: %w", err))
		}
	}
	if err := m.Pin(path); err != nil {
		m.Close()
		return nil, wrap(err)
	}
	// The kernel pins with 0600 minus the umask; chmod states it.
	if err := rootOnly(path, PinMode); err != nil {
		m.Close()
		return nil, wrap(err)
	}
	return m, nil
}

// PinMode and PinDirMode are the permissions of the agent's pins and pin
// directories: a map's owner can read it (the NAT table shows every flow
// of the node) and write it (the datapath's decisions), so only root may.
const (
	PinMode    os.FileMode = 0o600
	PinDirMode os.FileMode = 0o700
)

// rootOnlyDir creates dir with PinDirMode, or narrows it to that: the pin
// directory is the agent's own, and one an older version made 0755 is
// tightened on the next start.
func rootOnlyDir(dir string) error {
	if err := os.MkdirAll(dir, PinDirMode); err != nil {
		return err
	}
	return rootOnly(dir, PinDirMode)
}

// rootOnly narrows path to mode if it grants more.
func rootOnly(path string, mode os.FileMode) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.Mode().Perm()&^mode == 0 {
		return nil
	}
	if err := os.Chmod(path, mode); err != nil {
		return fmt.Errorf("chmod %o: %w", mode, err)
	}
	return nil
}

func layoutOf(typ ebpf.MapType, keySize, valueSize, maxEntries, flags uint32) string {
	return fmt.Sprintf("type=%s key=%dB value=%dB max_entries=%d flags=%#x",
		typ, keySize, valueSize, maxEntries, flags)
}

// copyEntries copies every entry of from into to, as far as to has room.
// An LRU map never runs out of room (it evicts), so the copy stops at its
// size: entries copied earlier are not silently evicted by later ones. A
// value of to longer than from's is from's followed by zeros: a layout
// that grew by fields appended at its end, zero for the old entries.
func copyEntries(from, to *ebpf.Map) (copied, dropped int) {
	key := make([]byte, from.KeySize())
	old := make([]byte, from.ValueSize())
	val := make([]byte, to.ValueSize()) // the tail stays zero
	lru := to.Type() == ebpf.LRUHash || to.Type() == ebpf.LRUCPUHash
	it := from.Iterate()
	for it.Next(&key, &old) {
		copy(val, old)
		if lru && copied >= int(to.MaxEntries()) {
			dropped++
			continue
		}
		if err := to.Update(key, val, ebpf.UpdateNoExist); err != nil {
			dropped++
			continue
		}
		copied++
	}
	return copied, dropped
}

// CheckBPFFS returns a clear error when root is not a mounted BPF
// filesystem, naming the command that mounts one.
func CheckBPFFS(root string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return fmt.Errorf("--bpf-root %s is unusable: %w (mount one with: mount -t bpf bpf %s)", root, err, root)
	}
	if uint32(st.Type) != unix.BPF_FS_MAGIC {
		return fmt.Errorf("--bpf-root %s is not a BPF filesystem (mount one with: mount -t bpf bpf %s)", root, root)
	}
	return nil
}
