package bpf

import (
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// TestNoRaces races, through BPF_PROG_TEST_RUN, SYNs of many sources on
// every CPU at one server with 4 NAT ports and pairs that expire within
// 20 µs (so that ports are taken over, and pairs reopened, all the time),
// against a collector ending every pair it finds (EndPairV4/V6: the kernel
// judges). Afterwards every pair is whole: each egress entry's reply entry
// points back at it and each reply entry's egress entry at it, so no two
// flows share a NAT tuple and no pair lost a half. Before the claims
// (lib/flow.h NAT_CLAIMED) two CPUs could both take over one expired pair,
// and the collector, which deleted by key, removed reply entries a
// takeover had just written (main's object with such a collector: 6 to 112
// broken pairs in every run of this scenario).
func TestNoRaces(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) {
		e := raceEnv(t)
		raceSYNs(t, e, false, e.dp.EndPairV4, func(m *ebpf.Map) []error {
			return brokenPairs(m, PeerV4, func(k NATKeyV4) string {
				return fmt.Sprintf("dir %d %v:%d → %v:%d", k.Dir, AddrFrom4(k.Src), HostPort(k.Sport), AddrFrom4(k.Dst), HostPort(k.Dport))
			})
		})
	})
	t.Run("ipv6", func(t *testing.T) {
		e := raceEnv(t)
		raceSYNs(t, e, true, e.dp.EndPairV6, func(m *ebpf.Map) []error {
			return brokenPairs(m, PeerV6, func(k NATKeyV6) string {
				return fmt.Sprintf("dir %d %v:%d → %v:%d", k.Dir, netip.AddrFrom16(k.Src), HostPort(k.Sport),
					netip.AddrFrom16(k.Dst), HostPort(k.Dport))
			})
		})
	})
}

func raceEnv(t *testing.T) *testEnv {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61003, natMax: 1 << 16})
	if err := e.dp.SetKeepSourcePort(false); err != nil {
		t.Fatal(err)
	}
	l := DefaultLifetimes
	l.TCPSyn = 20 * time.Microsecond
	if err := e.dp.SetLifetimes(l); err != nil {
		t.Fatal(err)
	}
	return e
}

// natKey is a NAT map key: NATKeyV4 or NATKeyV6.
type natKey interface {
	comparable
	dir() uint8
}

func (k NATKeyV4) dir() uint8 { return k.Dir }
func (k NATKeyV6) dir() uint8 { return k.Dir }

func raceSYNs[K natKey](t *testing.T, e *testEnv, v6 bool, end func(K, bool) (GCResult, error),
	broken func(*ebpf.Map) []error) {
	m, dst := e.dp.Maps.NatV4, remote4
	if v6 {
		m, dst = e.dp.Maps.NatV6, remote6
	}
	workers := max(4*runtime.GOMAXPROCS(0), 8)
	const perWorker = 10000
	var (
		wg, gc     sync.WaitGroup
		stop       atomic.Bool
		translated atomic.Int64
		ended      atomic.Int64
		errs       = make(chan error, workers+1)
		before     = e.counters()
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			src := netip.AddrFrom4([4]byte{10, 0, byte(w >> 8), byte(w) + 1})
			if v6 {
				a := pod6.As16()
				a[14], a[15] = byte(w>>8), byte(w)+1
				src = netip.AddrFrom16(a)
			}
			out := make([]byte, 256)
			for i := range perWorker {
				// Half the workers send new flows only (a broken pair
				// stays), half cycle over 4 source ports: their SYNs
				// reopen their pairs, or meet them taken over.
				sport := uint16(20000 + i)
				if w%2 == 1 {
					sport = uint16(20000 + i%4)
				}
				f := flow{src: src, dst: dst, proto: protoTCP, sport: sport, dport: 443, tcpFlags: tcpSYN}
				ret, err := e.dp.Egress.Run(&ebpf.RunOptions{Data: f.packet(), DataOut: out, Context: skbContext{Ifindex: loIfindex}})
				if err != nil {
					errs <- err
					return
				}
				if ret == tcActUnspec {
					translated.Add(1)
				}
			}
		}()
	}
	// The collector: every reply entry found is offered to the kernel,
	// which ends the pairs that have expired, both halves. (Offered egress
	// entries too, it would also end the halves a race left, and hide
	// them from the check below.)
	gc.Add(1)
	go func() {
		defer gc.Done()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		for !stop.Load() {
			var keys []K
			var k K
			var v []byte
			it := m.Iterate()
			for it.Next(&k, &v) {
				if k.dir() == DirIngress {
					keys = append(keys, k)
				}
			}
			for _, k := range keys {
				res, err := end(k, false)
				if err != nil {
					errs <- err
					return
				}
				if res == GCEnded {
					ended.Add(1)
				}
			}
		}
	}()
	wg.Wait()
	stop.Store(true)
	gc.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	c := e.counters()
	delta := func(n Counter) uint64 { return c[n] - before[n] }
	t.Logf("%d workers, %d SYNs translated, %d ports taken over, %d pairs reopened, %d SYNs dropped losing a claim, %d pairs ended by the collector",
		workers, translated.Load(), delta(CounterNATReused), delta(CounterNATReopened), delta(CounterDropPairClaimed), ended.Load())
	if delta(CounterNATReused) == 0 || delta(CounterNATReopened) == 0 || ended.Load() == 0 {
		t.Fatal("no takeover, reopen or collection: the test raced nothing")
	}
	if bad := broken(m); len(bad) > 0 {
		t.Fatalf("%d broken pairs, e.g. %v", len(bad), bad[:min(len(bad), 5)])
	}
}

// brokenPairs lists the entries of m whose other half is missing or
// belongs to another flow.
func brokenPairs[K natKey, V any](m *ebpf.Map, peer func(K, V) K, name func(K) string) []error {
	var (
		k, pk K
		v, pv V
		bad   []error
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if k.dir() == DirInbound {
			continue
		}
		pk = peer(k, v)
		if err := m.Lookup(pk, &pv); err != nil {
			bad = append(bad, fmt.Errorf("%s: other half missing", name(k)))
			continue
		}
		if peer(pk, pv) != k {
			bad = append(bad, fmt.Errorf("%s: its other half belongs to %s", name(k), name(peer(pk, pv))))
		}
	}
	if err := it.Err(); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		bad = append(bad, err)
	}
	return bad
}

// TestPairBeingCreatedNotTaken: a reply entry another CPU has just
// inserted (its egress entry not yet there), stamped after this CPU read
// its clock, is not a half pair to take over: time differences are signed.
func TestPairBeingCreatedNotTaken(t *testing.T) {
	e := newEnv(t, envOptions{portMin: 61000, portMax: 61000})
	later := monoNow() + uint64(10*time.Millisecond)
	in := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(61000), Proto: protoTCP, Dir: DirIngress}
	if err := e.dp.Maps.NatV4.Put(in, NATValV4{Addr: Addr4(pod1), Port: Port(40000), LastSeenNs: later, CreatedNs: later}); err != nil {
		t.Fatal(err)
	}
	b := flow{src: pod2, dst: remote4, proto: protoTCP, sport: 40001, dport: 443}
	before := e.counters()
	if ret, _ := e.run(e.dp.Egress, b.packet()); ret != tcActShot {
		t.Fatalf("a flow took the port of a pair being created: verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	e.checkCounters(before, map[Counter]uint64{CounterNoPort: 1})
}

func monoNow() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// TestCollectKeepsPairBeingCreated: a reply entry whose egress entry is not
// there yet, made within the second, is a pair another CPU is making (the
// reply entry goes in first): the collector keeps it even when its lifetime
// is over, and ends it once it is older than that. Ending it left the
// other CPU's egress entry alone (TestNoRaces, with 20 µs lifetimes: about
// one run in fifteen).
func TestCollectKeepsPairBeingCreated(t *testing.T) {
	e := raceEnv(t) // unanswered SYNs live 20 µs
	in := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(snat4), Sport: Port(443), Dport: Port(61000), Proto: protoTCP, Dir: DirIngress}
	now := monoNow()
	if err := e.dp.Maps.NatV4.Put(in, NATValV4{Addr: Addr4(pod1), Port: Port(40000), LastSeenNs: now, CreatedNs: now}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Millisecond)
	if res, err := e.dp.EndPairV4(in, false); err != nil || res != GCKept {
		t.Fatalf("a pair being made, 1 ms old: %v %v, want kept", res, err)
	}
	old := now - uint64(2*time.Second)
	if err := e.dp.Maps.NatV4.Put(in, NATValV4{Addr: Addr4(pod1), Port: Port(40000), LastSeenNs: old, CreatedNs: old}); err != nil {
		t.Fatal(err)
	}
	if res, err := e.dp.EndPairV4(in, false); err != nil || res != GCEnded {
		t.Fatalf("a reply entry alone for 2 s: %v %v, want ended", res, err)
	}
}
