package nonmasqmaps

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/settings"
)

// Maps holds the opened nonmasq maps; a map is nil when its family is
// disabled.
type Maps struct {
	V4 *bpfmap.Map[bpf.LPMKeyV4, uint8]
	V6 *bpfmap.Map[bpf.LPMKeyV6, uint8]

	closers []*ebpf.Map
}

// CheckBPFFS returns a clear error when root is not a mounted BPF filesystem.
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

// OpenMaps opens (or creates) the pinned maps of the enabled families.
func OpenMaps(log *slog.Logger, cfg settings.Config) (*Maps, error) {
	if err := CheckBPFFS(cfg.BPFRoot); err != nil {
		return nil, err
	}
	return open(func(name string, enabled bool) (*ebpf.Map, error) {
		if !enabled {
			return nil, nil
		}
		return bpf.OpenNonMasq(log, cfg.PinDir(), name, cfg.MaxNonMasqCIDRs)
	}, cfg.EnableIPv4, cfg.EnableIPv6)
}

// LoadPinnedMaps opens the existing pinned maps read-only for inspection
// (e.g. by "ipmasq-agent maps"), without creating or replacing anything.
func LoadPinnedMaps(pinDir string) (*Maps, error) {
	m, err := open(func(name string, _ bool) (*ebpf.Map, error) {
		raw, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", name, err)
		}
		return raw, nil
	}, true, true)
	if err != nil {
		return nil, err
	}
	if m.V4 == nil && m.V6 == nil {
		return nil, fmt.Errorf("no ipmasq maps pinned in %s (is the agent's --bpf-root the same?)", pinDir)
	}
	return m, nil
}

// open opens each family's map with openMap (nil, nil: none) and reads it
// into its cache.
func open(openMap func(name string, enabled bool) (*ebpf.Map, error), v4, v6 bool) (*Maps, error) {
	m := &Maps{}
	var err error
	if m.V4, err = openFamily[bpf.LPMKeyV4](m, openMap, bpf.MapNonMasqV4, v4); err != nil {
		m.Close()
		return nil, err
	}
	if m.V6, err = openFamily[bpf.LPMKeyV6](m, openMap, bpf.MapNonMasqV6, v6); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

func openFamily[K comparable](m *Maps, openMap func(string, bool) (*ebpf.Map, error), name string, enabled bool) (*bpfmap.Map[K, uint8], error) {
	raw, err := openMap(name, enabled)
	if err != nil || raw == nil {
		return nil, err
	}
	m.closers = append(m.closers, raw)
	cached, err := bpfmap.NewMap[K, uint8](raw)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	return cached, nil
}

// Close releases the map file descriptors; the pins stay.
func (m *Maps) Close() {
	for _, c := range m.closers {
		c.Close()
	}
	m.closers = nil
}
