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
	m := &Maps{}
	if cfg.EnableIPv4 {
		raw, err := bpf.OpenNonMasq(log, cfg.PinDir(), bpf.MapNonMasqV4, cfg.MaxNonMasqCIDRs)
		if err != nil {
			return nil, err
		}
		m.closers = append(m.closers, raw)
		if m.V4, err = bpfmap.NewMap[bpf.LPMKeyV4, uint8](raw); err != nil {
			m.Close()
			return nil, fmt.Errorf("read %s: %w", bpf.MapNonMasqV4, err)
		}
	}
	if cfg.EnableIPv6 {
		raw, err := bpf.OpenNonMasq(log, cfg.PinDir(), bpf.MapNonMasqV6, cfg.MaxNonMasqCIDRs)
		if err != nil {
			m.Close()
			return nil, err
		}
		m.closers = append(m.closers, raw)
		if m.V6, err = bpfmap.NewMap[bpf.LPMKeyV6, uint8](raw); err != nil {
			m.Close()
			return nil, fmt.Errorf("read %s: %w", bpf.MapNonMasqV6, err)
		}
	}
	return m, nil
}

// Close releases the map file descriptors; the pins stay.
func (m *Maps) Close() {
	for _, c := range m.closers {
		c.Close()
	}
	m.closers = nil
}

// LoadPinnedMaps opens the existing pinned maps read-only for inspection
// (e.g. by "ipmasq-agent maps"), without creating or replacing anything.
func LoadPinnedMaps(pinDir string) (*Maps, error) {
	m := &Maps{}
	opts := &ebpf.LoadPinOptions{ReadOnly: true}
	if raw, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, bpf.MapNonMasqV4), opts); err == nil {
		m.closers = append(m.closers, raw)
		if m.V4, err = bpfmap.NewMap[bpf.LPMKeyV4, uint8](raw); err != nil {
			m.Close()
			return nil, fmt.Errorf("read %s: %w", bpf.MapNonMasqV4, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("open %s: %w", bpf.MapNonMasqV4, err)
	}
	if raw, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, bpf.MapNonMasqV6), opts); err == nil {
		m.closers = append(m.closers, raw)
		if m.V6, err = bpfmap.NewMap[bpf.LPMKeyV6, uint8](raw); err != nil {
			m.Close()
			return nil, fmt.Errorf("read %s: %w", bpf.MapNonMasqV6, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		m.Close()
		return nil, fmt.Errorf("open %s: %w", bpf.MapNonMasqV6, err)
	}
	if m.V4 == nil && m.V6 == nil {
		return nil, fmt.Errorf("no ipmasq maps pinned in %s (is the agent's --bpf-root the same?)", pinDir)
	}
	return m, nil
}
