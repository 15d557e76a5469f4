package natview

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/internal/testkit/netnstest"
	"github.com/ipmasq/ipmasq/internal/testkit/privtest"
)

// The listing of n NAT pairs against conntrack -L of n conntrack entries,
// in the same run. conntrack's table is capped by nf_conntrack_max, which
// only the host's own namespace may raise (262 144 here): a test may not
// change it, so conntrack is measured at 200 000 entries and ipmasq at
// 200 000 and 1 000 000 pairs (two map entries each).
//
//	go test -run '^$' -bench 'NATList|ConntrackList' -benchtime 5x ./readers/natview/

// natMaps pins a nat_v4 of n pairs (and an empty nat_v6 and the config
// map, which the listing reads too) in a private bpffs, without loading
// the programs.
func natMaps(b *testing.B, pairs int) bpf.Pinned {
	b.Helper()
	dir := filepath.Join(privtest.MountBPFFS(b), "ipmasq")
	if err := unix.Mkdir(dir, 0o700); err != nil {
		b.Fatal(err)
	}
	newMap := func(name string, typ ebpf.MapType, key, val any, n int) *ebpf.Map {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Name: name, Type: typ, KeySize: uint32(binary.Size(key)),
			ValueSize: uint32(binary.Size(val)), MaxEntries: uint32(n)})
		if err != nil {
			b.Fatalf("create %s: %v", name, err)
		}
		if err := m.Pin(filepath.Join(dir, name)); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { m.Close() })
		return m
	}
	v4 := newMap(bpf.MapNATV4, ebpf.LRUHash, bpf.NATKeyV4{}, bpf.NATValV4{}, 2*pairs+1024)
	newMap(bpf.MapNATV6, ebpf.LRUHash, bpf.NATKeyV6{}, bpf.NATValV6{}, 16)
	cfg := newMap(bpf.MapConfig, ebpf.Array, uint32(0), bpf.Config{}, 1)
	var c bpf.Config
	for i, d := range []uint64{60e9, 6 * 3600e9, 120e9, 10e9, 30e9, 120e9, 30e9, 600e9} {
		c.TimeoutNs[i] = d
	}
	if err := cfg.Put(uint32(0), c); err != nil {
		b.Fatal(err)
	}
	now := monotonicNow()
	const chunk = 1 << 16
	keys := make([]bpf.NATKeyV4, 0, chunk)
	vals := make([]bpf.NATValV4, 0, chunk)
	snat := bpf.Addr4(netip.MustParseAddr("10.0.0.5"))
	for i := range pairs {
		// Every pair its own tuples both ways: 60 000 NAT ports toward
		// each of 17 remotes.
		pod := netip.AddrFrom4([4]byte{10, 244, byte(i >> 16), byte(i >> 8)})
		remote := netip.AddrFrom4([4]byte{198, 18, byte(i / 60000), 7})
		k := bpf.NATKeyV4{Src: bpf.Addr4(pod), Dst: bpf.Addr4(remote),
			Sport: bpf.Port(uint16(1024 + i%60000)), Dport: bpf.Port(443), Proto: bpf.ProtoTCP, Dir: bpf.DirEgress}
		v := bpf.NATValV4{Addr: snat, Port: bpf.Port(uint16(1024 + i%60000)), CreatedNs: now, LastSeenNs: now}
		keys, vals = append(keys, k, bpf.PeerV4(k, v)), append(vals, v, bpf.NATValV4{Addr: k.Src, Port: k.Sport,
			Flags: bpf.NATFlagSeen, CreatedNs: now, LastSeenNs: now})
		if len(keys) >= chunk || i == pairs-1 {
			if _, err := v4.BatchUpdate(keys, vals, nil); err != nil {
				b.Fatal(err)
			}
			keys, vals = keys[:0], vals[:0]
		}
	}
	pinned := bpf.Pinned{Dir: dir}
	if fill, err := pinned.NATFill(); err != nil || fill[0].Entries != 2*pairs {
		b.Fatalf("nat_v4 holds %v (%v), want %d entries", fill, err, 2*pairs)
	}
	return pinned
}

func BenchmarkNATList(b *testing.B) {
	for _, pairs := range []int{200_000, 1_000_000} {
		src := natMaps(b, pairs)
		for _, o := range []Options{{Output: "text"}, {Output: "json"}, {Output: "text", Summary: true}} {
			name := fmt.Sprintf("pairs=%d/%s", pairs, o.Output)
			if o.Summary {
				name = fmt.Sprintf("pairs=%d/summary", pairs)
			}
			b.Run(name, func(b *testing.B) {
				for b.Loop() {
					if err := Write(io.Discard, src, o); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(pairs), "pairs")
			})
		}
	}
}

// BenchmarkConntrackList is conntrack -L (conntrack-tools) listing
// 200 000 UDP entries created over ctnetlink in a namespace of its own.
func BenchmarkConntrackList(b *testing.B) {
	const entries = 200_000
	bin, err := exec.LookPath("conntrack")
	if err != nil {
		b.Fatalf("conntrack (Debian package conntrack) is needed for the baseline: %v", err)
	}
	ns, h := privtest.NewNetns(b)
	for i := range entries {
		src := net.IPv4(10, 244, byte(i>>16), byte(i>>8))
		dst := net.IPv4(198, 51, 100, 7)
		sport, dport := uint16(1024+i%60000), uint16(443)
		flow := &netlink.ConntrackFlow{FamilyType: unix.AF_INET, TimeOut: 3600,
			Forward: netlink.IPTuple{Protocol: unix.IPPROTO_UDP, SrcIP: src, DstIP: dst, SrcPort: sport, DstPort: dport},
			Reverse: netlink.IPTuple{Protocol: unix.IPPROTO_UDP, SrcIP: dst, DstIP: net.IPv4(10, 0, 0, 5), SrcPort: dport, DstPort: sport}}
		if err := h.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, flow); err != nil {
			b.Fatalf("create conntrack entry %d: %v", i, err)
		}
	}
	b.Run(fmt.Sprintf("entries=%d", entries), func(b *testing.B) {
		for b.Loop() {
			cmd := exec.Command(bin, "-L")
			cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
			if err := netnstest.Do(ns, cmd.Run); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(entries, "entries")
	})
}
