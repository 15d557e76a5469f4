// Package settings holds the agent-wide settings that several cells
// share: which address families are enabled, where the BPF filesystem and
// the persistent state are, and how large the non-masquerade maps are. Each cell reads them from the
// hive instead of defining its own copy of the flag.
package settings

import (
	"fmt"
	"path/filepath"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
)

// PinDirName is the directory under --bpf-root that holds every ipmasq map
// and link.
const PinDirName = "ipmasq"

// Config is the agent-wide configuration.
type Config struct {
	// BPFRoot is the mount point of the BPF filesystem.
	BPFRoot string
	// EnableIPv4 enables IPv4 masquerading.
	EnableIPv4 bool `mapstructure:"enable-ipv4"`
	// EnableIPv6 enables IPv6 masquerading.
	EnableIPv6 bool `mapstructure:"enable-ipv6"`
	// MaxNonMasqCIDRs is the capacity of each nonmasq map (per family).
	MaxNonMasqCIDRs uint32 `mapstructure:"max-nonmasq-cidrs"`
	// StateDir holds the agent's persistent state: the endpoints (IPAM)
	// and the last Node pod CIDRs seen (Kubernetes).
	StateDir string `mapstructure:"state-dir"`
}

// Default is the configuration used when no flag is given. IPv6 is off
// unless --enable-ipv6 is given, as in the Kubernetes ip-masq-agent: its
// DaemonSet, run with ipmasq's image, then leaves IPv6 traffic untouched and
// rejects an IPv6 prefix in the file exactly as it did.
var Default = Config{
	BPFRoot:         "/sys/fs/bpf",
	EnableIPv4:      true,
	EnableIPv6:      false,
	MaxNonMasqCIDRs: 16384,
	StateDir:        "/var/lib/ipmasq",
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("bpf-root", def.BPFRoot, "Mount point of the BPF filesystem; maps are pinned under <bpf-root>/"+PinDirName)
	flags.Bool("enable-ipv4", def.EnableIPv4, "Masquerade IPv4 traffic")
	flags.Bool("enable-ipv6", def.EnableIPv6, "Masquerade IPv6 traffic (off by default, as in the Kubernetes ip-masq-agent)")
	flags.Uint32("max-nonmasq-cidrs", def.MaxNonMasqCIDRs, "Capacity of each non-masquerade map, per address family")
	flags.String("state-dir", def.StateDir, "Directory of the agent's persistent state (endpoint allocations, the Node's last pod CIDRs)")
}

// PinDir is the directory holding the agent's pinned maps.
func (c Config) PinDir() string { return filepath.Join(c.BPFRoot, PinDirName) }

// Validate rejects settings the agent cannot run with.
func (c Config) Validate() error {
	if !c.EnableIPv4 && !c.EnableIPv6 {
		return fmt.Errorf("--enable-ipv4 and --enable-ipv6 are both false: at least one address family must be enabled")
	}
	if c.MaxNonMasqCIDRs == 0 {
		return fmt.Errorf("--max-nonmasq-cidrs=0: the non-masquerade maps need room for at least one prefix")
	}
	if c.StateDir == "" {
		return fmt.Errorf("--state-dir is empty: give the directory of the agent's persistent state, e.g. %s", Default.StateDir)
	}
	if c.BPFRoot == "" {
		return fmt.Errorf("--bpf-root is empty: give the mount point of the BPF filesystem, e.g. /sys/fs/bpf")
	}
	return nil
}

// Cell provides Config from the command line.
var Cell = cell.Group(
	cell.Config(Default),
	cell.Invoke(Config.Validate),
)
