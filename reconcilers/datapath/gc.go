package datapath

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
)

// Idle timeouts of NAT pairs. A closed TCP pair is kept for longer than
// TIME_WAIT (60 s on Linux) so its NAT port is not handed to a new flow to
// the same server while the server may still hold the old connection: such
// a SYN would be dropped (PAWS).
const (
	TimeoutTCP       = 6 * time.Hour
	TimeoutTCPClosed = 2 * time.Minute
	TimeoutUDP       = time.Minute
	TimeoutICMP      = 30 * time.Second
)

const (
	protoICMP   = 1
	protoTCP    = 6
	protoUDP    = 17
	protoICMPv6 = 58
)

func timeout(proto uint8, flags uint8) time.Duration {
	switch proto {
	case protoTCP:
		if flags&(bpf.NATFlagFIN|bpf.NATFlagRST) != 0 {
			return TimeoutTCPClosed
		}
		return TimeoutTCP
	case protoUDP:
		return TimeoutUDP
	}
	return TimeoutICMP
}

// monotonicNow is the clock of bpf_ktime_get_ns.
func monotonicNow() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// collector expires idle NAT pairs. Both directions of a pair are judged
// together: a pair is idle when neither direction has seen a packet for the
// timeout of its protocol and state. Pairs translated to an address that is
// no longer the SNAT address of any device are removed at once: the
// programs decide once per flow, so such a flow would keep sending from an
// address the node no longer has.
type collector struct {
	log *slog.Logger
	dp  *Handle
	// snat returns the current SNAT addresses, or ok=false while they are
	// not known yet (then nothing is removed for that reason).
	snat func() (addrs map[netip.Addr]bool, ok bool)
}

// GCStats says what one collection did.
type GCStats struct {
	Entries, Expired int
}

func (c *collector) collect(ctx context.Context) error { return c.collectNow() }

func (c *collector) collectNow() error {
	dp := c.dp.get()
	if dp == nil {
		return nil
	}
	var snat map[netip.Addr]bool
	if c.snat != nil {
		if addrs, ok := c.snat(); ok {
			snat = addrs
		}
	}
	s4, err4 := collectV4(dp.Maps.NatV4, monotonicNow(), snat)
	s6, err6 := collectV6(dp.Maps.NatV6, monotonicNow(), snat)
	if c.log != nil && s4.Expired+s6.Expired > 0 {
		c.log.Debug("NAT entries expired", "ipv4", s4.Expired, "ipv6", s6.Expired)
	}
	return errors.Join(err4, err6)
}

// natEntry is what the collector needs to know of one NAT entry.
type natEntry[K comparable] struct {
	peer     K // the key of the other direction
	proto    uint8
	dir      uint8
	flags    uint8
	lastSeen uint64
	snat     netip.Addr // the SNAT address of the pair
}

func describeV4(k bpf.NATKeyV4, v bpf.NATValV4) natEntry[bpf.NATKeyV4] {
	e := natEntry[bpf.NATKeyV4]{peer: pairV4(k, v), proto: k.Proto, dir: k.Dir, flags: v.Flags, lastSeen: v.LastSeenNs}
	if k.Dir == bpf.DirEgress {
		e.snat = bpf.AddrFrom4(v.Addr)
	} else {
		e.snat = bpf.AddrFrom4(k.Dst)
	}
	return e
}

func describeV6(k bpf.NATKeyV6, v bpf.NATValV6) natEntry[bpf.NATKeyV6] {
	e := natEntry[bpf.NATKeyV6]{peer: pairV6(k, v), proto: k.Proto, dir: k.Dir, flags: v.Flags, lastSeen: v.LastSeenNs}
	if k.Dir == bpf.DirEgress {
		e.snat = netip.AddrFrom16(v.Addr)
	} else {
		e.snat = netip.AddrFrom16(k.Dst)
	}
	return e
}

// collectV4 expires idle IPv4 pairs as of now (monotonic ns), and pairs
// whose SNAT address is not in snat (when snat is not nil).
func collectV4(m *ebpf.Map, now uint64, snat map[netip.Addr]bool) (GCStats, error) {
	return collectMap(m, bpf.MapNATV4, now, snat, describeV4)
}

// collectV6 is collectV4 for IPv6.
func collectV6(m *ebpf.Map, now uint64, snat map[netip.Addr]bool) (GCStats, error) {
	return collectMap(m, bpf.MapNATV6, now, snat, describeV6)
}

func collectMap[K comparable, V comparable](m *ebpf.Map, name string, now uint64, snat map[netip.Addr]bool,
	describe func(K, V) natEntry[K]) (GCStats, error) {
	// Batch reads and deletes: one syscall per few hundred entries rather
	// than two per entry, so a large table costs little CPU per pass.
	bm, err := bpfmap.NewMap[K, V](m)
	if err != nil {
		return GCStats{}, fmt.Errorf("read %s: %w", name, err)
	}
	// NewMap has just read the whole map.
	entries := bm.Contents()
	all := make(map[K]natEntry[K], len(entries))
	for k, v := range entries {
		all[k] = describe(k, v)
	}
	var expired []K
	for k, e := range all {
		last, flags := e.lastSeen, e.flags
		if p, ok := all[e.peer]; ok {
			last, flags = max(last, p.lastSeen), flags|p.flags
		}
		if idle(now, last, e.proto, flags) || (snat != nil && !snat[e.snat]) {
			expired = append(expired, k)
		}
	}
	var errs []error
	for _, err := range bm.Delete(expired) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	return GCStats{Entries: len(all), Expired: len(expired)}, errors.Join(errs...)
}

func idle(now, last uint64, proto, flags uint8) bool {
	return now > last && time.Duration(now-last) > timeout(proto, flags)
}

// pairV4 is the key of the other direction of a pair. Egress: pod → remote
// translated to SNAT:port, so the reply key is remote → SNAT:port. Ingress:
// remote → SNAT:port back to pod:port, so the egress key is pod → remote.
func pairV4(k bpf.NATKeyV4, v bpf.NATValV4) bpf.NATKeyV4 {
	if k.Dir == bpf.DirEgress {
		return bpf.NATKeyV4{Src: k.Dst, Dst: v.Addr, Sport: k.Dport, Dport: v.Port, Proto: k.Proto, Dir: bpf.DirIngress}
	}
	return bpf.NATKeyV4{Src: v.Addr, Dst: k.Src, Sport: v.Port, Dport: k.Sport, Proto: k.Proto, Dir: bpf.DirEgress}
}

// pairV6 is pairV4 for IPv6.
func pairV6(k bpf.NATKeyV6, v bpf.NATValV6) bpf.NATKeyV6 {
	if k.Dir == bpf.DirEgress {
		return bpf.NATKeyV6{Src: k.Dst, Dst: v.Addr, Sport: k.Dport, Dport: v.Port, Proto: k.Proto, Dir: bpf.DirIngress}
	}
	return bpf.NATKeyV6{Src: v.Addr, Dst: k.Src, Sport: v.Port, Dport: k.Sport, Proto: k.Proto, Dir: bpf.DirEgress}
}
