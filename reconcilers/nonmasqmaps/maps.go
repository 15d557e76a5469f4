package nonmasqmaps

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/settings"
)

// Map names under <bpf-root>/ipmasq/.
const (
	MapNameV4 = "nonmasq_v4"
	MapNameV6 = "nonmasq_v6"
)

// Maps holds the opened nonmasq maps; a map is nil when its family is
// disabled.
type Maps struct {
	V4 *bpfmap.Map[bpfmap.LPMKeyV4, uint8]
	V6 *bpfmap.Map[bpfmap.LPMKeyV6, uint8]

	rawV4, rawV6 *ebpf.Map
	closers      []*ebpf.Map
}

// RawV4 is the IPv4 map itself (nil when IPv4 is disabled), for the
// datapath programs that read it.
func (m *Maps) RawV4() *ebpf.Map { return m.rawV4 }

// RawV6 is the IPv6 map itself (nil when IPv6 is disabled).
func (m *Maps) RawV6() *ebpf.Map { return m.rawV6 }

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
		raw, err := bpfmap.OpenPinned(log, cfg.PinDir(), bpfmap.LPMTrieSpec(MapNameV4, 8, 1, cfg.MaxNonMasqCIDRs))
		if err != nil {
			return nil, err
		}
		m.closers, m.rawV4 = append(m.closers, raw), raw
		if m.V4, err = bpfmap.NewMap[bpfmap.LPMKeyV4, uint8](raw); err != nil {
			m.Close()
			return nil, fmt.Errorf("read %s: %w", MapNameV4, err)
		}
	}
	if cfg.EnableIPv6 {
		raw, err := bpfmap.OpenPinned(log, cfg.PinDir(), bpfmap.LPMTrieSpec(MapNameV6, 20, 1, cfg.MaxNonMasqCIDRs))
		if err != nil {
			m.Close()
			return nil, err
		}
		m.closers, m.rawV6 = append(m.closers, raw), raw
		if m.V6, err = bpfmap.NewMap[bpfmap.LPMKeyV6, uint8](raw); err != nil {
			m.Close()
			return nil, fmt.Errorf("read %s: %w", MapNameV6, err)
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
	if raw, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, MapNameV4), opts); err == nil {
		m.closers = append(m.closers, raw)
		if m.V4, err = bpfmap.NewMap[bpfmap.LPMKeyV4, uint8](raw); err != nil {
			m.Close()
			return nil, fmt.Errorf("read %s: %w", MapNameV4, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("open %s: %w", MapNameV4, err)
	}
	if raw, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, MapNameV6), opts); err == nil {
		m.closers = append(m.closers, raw)
		if m.V6, err = bpfmap.NewMap[bpfmap.LPMKeyV6, uint8](raw); err != nil {
			m.Close()
			return nil, fmt.Errorf("read %s: %w", MapNameV6, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		m.Close()
		return nil, fmt.Errorf("open %s: %w", MapNameV6, err)
	}
	if m.V4 == nil && m.V6 == nil {
		return nil, fmt.Errorf("no ipmasq maps pinned in %s (is the agent's --bpf-root the same?)", pinDir)
	}
	return m, nil
}
