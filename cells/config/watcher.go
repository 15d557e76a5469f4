package config

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/fsnotify/fsnotify"
)

// dirWatcher watches the directory of the config file and signals every
// change in it. The directory, not the file, is watched so that editors'
// rename dance and the Kubernetes ConfigMap "..data" symlink swap are seen:
// both replace the file rather than write it. While the directory does not
// exist its nearest existing ancestor is watched instead, so the agent
// notices the directory appearing without polling.
type dirWatcher struct {
	log     *slog.Logger
	dir     string
	w       *fsnotify.Watcher
	watched string
	changed chan struct{}
}

func newDirWatcher(log *slog.Logger, dir string) (*dirWatcher, error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	d := &dirWatcher{log: log, dir: filepath.Clean(dir), w: w, changed: make(chan struct{}, 1)}
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
