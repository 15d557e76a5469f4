package e2e

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// TestDisabledFamilyNATMapIsSmall: with --enable-ipv6=false (the default)
// nat_v6 holds nothing, so it is created with 1 024 entries, not the
// enabled family's size (preallocated, that would be up to 76 MiB of kernel
// memory for nothing); the log says so. Restarted with IPv6 enabled, the
// map gets the full size, and an IPv4 stream runs on through both starts,
// as it runs on under Linux MASQUERADE through a reload of its rules.
func TestDisabledFamilyNATMapIsSmall(t *testing.T) {
	underBoth(t, masqueradePods("--enable-ipv6=false", "--nat-max-entries=65536"), func(t *testing.T, s *scenario) {
		v4 := startStream(t, s.topo.Pod, topology.RemoteIP4)
		v4.progress(t, 64<<10, "IPv6 disabled")
		if a := s.agent; a != nil {
			a.waitFor("nat_v4 65536, nat_v6 1024 entries", func() bool {
				return a.natMapSize(bpf.MapNATV4) == 65536 && a.natMapSize(bpf.MapNATV6) == 1024
			})
			if log := readFile(t, a.log); !strings.Contains(log, "nat_v6 has 1024 (--enable-ipv6=false") {
				t.Errorf("the agent log does not say why nat_v6 is small:\n%s", log)
			}
			a.stop(syscall.SIGTERM)
			a.args = []string{"--enable-ipv6=true", "--nat-max-entries=65536"}
			a.start()
			a.waitFor("nat_v6 with 65536 entries", func() bool { return a.natMapSize(bpf.MapNATV6) == 65536 })
		} else {
			reloadLinuxMasquerade(t, s.topo)
		}
		v4.progress(t, 64<<10, "IPv6 enabled")
		v4.stop(t)
	})
}

// natMapSize is the max_entries of the pinned map name, 0 when it is not
// there.
func (a *agent) natMapSize(name string) uint32 {
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", name), nil)
	if err != nil {
		return 0
	}
	defer m.Close()
	return m.MaxEntries()
}
