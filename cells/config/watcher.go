package config

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"

	"github.com/fsnotify/fsnotify"
)

// dirWatcher watches the directory of the config file and signals every
// change in it that can change the config. The directory, not the file, is
// watched so that editors' rename dance and the Kubernetes ConfigMap
// "..data" symlink swap are seen: both replace the file rather than write
// it. While the directory does not exist its nearest existing ancestor is
// watched instead, so the agent notices the directory appearing without
// polling.
//
// Events of other entries of the directory (an editor's or the kubelet's
// temporary file being created and written) are ignored: each one used to
// cost a read of the config and woke the loader while the writer was still
// busy. The drop-ins merged with the config file (merge.go, isDropIn) and
// the entries they resolve through count as the config file does.
type dirWatcher struct {
	log     *slog.Logger
	dir     string
	name    string // the config file's name in dir
	w       *fsnotify.Watcher
	watched string
	changed chan struct{}

	// path holds the entries of dir the config path resolved through when
	// last looked at: the file's own name, and the symlinks (and their
	// targets) it leads through, such as a ConfigMap's ..data.
	path map[string]bool
	// ignored counts events that could not change the config.
	ignored atomic.Uint64
}

// newDirWatcher watches the directory of the config file at path.
func newDirWatcher(log *slog.Logger, path string) (*dirWatcher, error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	path = filepath.Clean(path)
	d := &dirWatcher{log: log, dir: filepath.Dir(path), name: filepath.Base(path), w: w, changed: make(chan struct{}, 1)}
	d.path = d.configEntries()
	if err := d.arm(); err != nil {
		w.Close()
		return nil, err
	}
	return d, nil
}

// Changed is signalled (coalesced) after any change in the watched tree.
func (d *dirWatcher) Changed() <-chan struct{} { return d.changed }

func (d *dirWatcher) signal() {
	select {
	case d.changed <- struct{}{}:
	default:
	}
}

// arm points the watch at the config directory, or at its nearest existing
// ancestor while it is missing. It repeats until the choice is stable so a
// directory created while arming is not missed.
func (d *dirWatcher) arm() error {
	for {
		target := nearestExisting(d.dir)
		if target == d.watched {
			return nil
		}
		if d.watched != "" {
			// The old watch may already be gone (directory removed).
			_ = d.w.Remove(d.watched)
		}
		if err := d.w.Add(target); err != nil {
			d.watched = ""
			return err
		}
		if target != d.dir {
			d.log.Info("Config directory does not exist; waiting for it to appear",
				"directory", d.dir, "watching", target)
		} else if d.watched != "" {
			d.log.Info("Watching config directory", "directory", d.dir)
		}
		d.watched = target
		d.signal()
	}
}

// nearestExisting returns dir if it is an existing directory, or its closest
// ancestor that is.
func nearestExisting(dir string) string {
	for {
		if fi, err := os.Stat(dir); err == nil && fi.IsDir() {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return dir
		}
		dir = parent
	}
}

// run forwards filesystem events as change signals until ctx is done.
func (d *dirWatcher) run(ctx context.Context) error {
	defer d.w.Close()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-d.w.Events:
			if !ok {
				return nil
			}
			if ev.Name == d.watched && ev.Has(fsnotify.Remove|fsnotify.Rename) {
				// The watch went away with the directory itself.
				d.watched = ""
			}
			if d.watched != d.dir {
				// Watching an ancestor: the directory may have appeared.
				d.rearm()
			} else if !d.affectsConfig(ev.Name) {
				d.ignored.Add(1)
				continue
			}
			d.signal()
		case err, ok := <-d.w.Errors:
			if !ok {
				return nil
			}
			// An overflow loses events: re-read the file to be sure.
			d.log.Warn("Config directory watch error; re-reading the config", "directory", d.dir, "error", err)
			d.watched = ""
			d.rearm()
			d.signal()
		}
	}
}

func (d *dirWatcher) rearm() {
	if err := d.arm(); err != nil {
		d.log.Error("Cannot watch config directory; changes are picked up at the next resync", "directory", d.dir, "error", err)
	}
}

// affectsConfig reports whether a change of name (an event's path) can
// change what reading the config path gives: it is the config file, the
// directory itself, or an entry the config path resolves through now or
// did before this event (a symlink swapped away still counts).
func (d *dirWatcher) affectsConfig(name string) bool {
	if filepath.Dir(name) != d.dir {
		return true // the directory itself, or something unexpected
	}
	before := d.path
	d.path = d.configEntries()
	base := filepath.Base(name)
	return base == d.name || isDropIn(base, d.name) || before[base] || d.path[base]
}

// configEntries returns the entries of dir that reading the config file and
// its drop-ins goes through (configPathEntries of each).
func (d *dirWatcher) configEntries() map[string]bool {
	entries := configPathEntries(d.dir, d.name)
	des, err := os.ReadDir(d.dir)
	if err != nil {
		return entries
	}
	for _, de := range des {
		if isDropIn(de.Name(), d.name) {
			for e := range configPathEntries(d.dir, de.Name()) {
				entries[e] = true
			}
		}
	}
	return entries
}

// maxSymlinkHops bounds the resolution of a symlink chain (the kernel's
// limit is 40); a loop just stops the walk.
const maxSymlinkHops = 40

// configPathEntries returns the names of the entries of dir that resolving
// dir/name goes through: name itself, and for each symlink on the way the
// first component of its target when that is in dir (a ConfigMap's file
// links through ..data, itself a link to a timestamped directory). Links
// that leave dir are not followed: nothing outside dir is watched.
func configPathEntries(dir, name string) map[string]bool {
	entries := map[string]bool{name: true}
	todo := []string{name} // paths relative to dir
	realDir := ""          // dir with its symlinks resolved, once needed
	for hops := 0; len(todo) > 0 && hops < maxSymlinkHops; hops++ {
		rel := todo[0]
		todo = todo[1:]
		parts := strings.Split(rel, string(filepath.Separator))
		cur := dir
		for i, part := range parts {
			cur = filepath.Join(cur, part)
			if i == 0 {
				entries[part] = true
			}
			target, err := os.Readlink(cur)
			if err != nil {
				continue // not a symlink (or gone): the next component
			}
			if !filepath.IsAbs(target) {
				target = filepath.Join(filepath.Dir(cur), target)
			}
			target = filepath.Join(append([]string{target}, parts[i+1:]...)...)
			next, ok := relativeTo(dir, target)
			if !ok {
				// An absolute link may name dir by its real path (dir
				// itself reached through a symlink).
				if realDir == "" {
					realDir, _ = filepath.EvalSymlinks(dir)
				}
				next, ok = relativeTo(realDir, target)
			}
			if ok {
				todo = append(todo, next)
			}
			break
		}
	}
	return entries
}

// relativeTo returns target relative to dir when it lies inside dir.
func relativeTo(dir, target string) (string, bool) {
	if dir == "" {
		return "", false
	}
	rel, err := filepath.Rel(dir, target)
	if err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return "", false
	}
	return rel, true
}
