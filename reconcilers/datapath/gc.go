package datapath

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
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
// timeout of its protocol and state.
type collector struct {
	log *slog.Logger
	dp  *loaded
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
	s4, err4 := collectV4(dp.Maps.NatV4, monotonicNow())
	s6, err6 := collectV6(dp.Maps.NatV6, monotonicNow())
	if c.log != nil && s4.Expired+s6.Expired > 0 {
		c.log.Debug("NAT entries expired", "ipv4", s4.Expired, "ipv6", s6.Expired)
	}
	return errors.Join(err4, err6)
}

// collectV4 expires idle IPv4 pairs as of now (monotonic ns).
func collectV4(m *ebpf.Map, now uint64) (GCStats, error) {
	all := map[bpf.NATKeyV4]bpf.NATValV4{}
	var k bpf.NATKeyV4
	var v bpf.NATValV4
	it := m.Iterate()
	for it.Next(&k, &v) {
		all[k] = v
	}
	if err := it.Err(); err != nil {
		return GCStats{}, fmt.Errorf("iterate %s: %w", bpf.MapNATV4, err)
	}
	var expired []bpf.NATKeyV4
	for k, v := range all {
		last, flags := v.LastSeenNs, v.Flags
		peer := pairV4(k, v)
		if pv, ok := all[peer]; ok {
			last, flags = max(last, pv.LastSeenNs), flags|pv.Flags
		}
		if now > last && time.Duration(now-last) > timeout(k.Proto, flags) {
			expired = append(expired, k)
		}
	}
	return GCStats{Entries: len(all), Expired: len(expired)}, deleteAll(m, expired)
}

// pairV4 is the key of the other direction of a pair.
func pairV4(k bpf.NATKeyV4, v bpf.NATValV4) bpf.NATKeyV4 {
	return bpf.NATKeyV4{Src: k.Dst, Dst: v.Addr, Sport: k.Dport, Dport: v.Port, Proto: k.Proto, Dir: 1 - k.Dir}
}

func collectV6(m *ebpf.Map, now uint64) (GCStats, error) {
	all := map[bpf.NATKeyV6]bpf.NATValV6{}
	var k bpf.NATKeyV6
	var v bpf.NATValV6
	it := m.Iterate()
	for it.Next(&k, &v) {
		all[k] = v
	}
	if err := it.Err(); err != nil {
		return GCStats{}, fmt.Errorf("iterate %s: %w", bpf.MapNATV6, err)
	}
	var expired []bpf.NATKeyV6
	for k, v := range all {
		last, flags := v.LastSeenNs, v.Flags
		peer := bpf.NATKeyV6{Src: k.Dst, Dst: v.Addr, Sport: k.Dport, Dport: v.Port, Proto: k.Proto, Dir: 1 - k.Dir}
		if pv, ok := all[peer]; ok {
			last, flags = max(last, pv.LastSeenNs), flags|pv.Flags
		}
		if now > last && time.Duration(now-last) > timeout(k.Proto, flags) {
			expired = append(expired, k)
		}
	}
	return GCStats{Entries: len(all), Expired: len(expired)}, deleteAll(m, expired)
}

func deleteAll[K any](m *ebpf.Map, keys []K) error {
	var errs []error
	for i := range keys {
		if err := m.Delete(&keys[i]); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
