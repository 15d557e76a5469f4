package bpf

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os/exec"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/testkit/ctfill"
)

// BenchmarkNewFlowFullTable: the CPU a new flow costs at a full NAT table
// (issue #32, #40): every pair answered (0 may go), 1 or 15 pairs that may
// go among them, or a quarter of the pairs ("quarter": unanswered UDP
// flows written by the test, each new flow drops one and is itself
// droppable, so the count stays), at 65 536, 524 288 and 1 048 576
// entries. The figure is the program's in-kernel time for the new flow's
// packet (BPF_PROG_TEST_RUN of one run, the kernel's timer reads
// included), the mean over b.N new flows after one not counted. Every
// slot of the notes (lib/evict.h) not holding a droppable pair's note
// holds a note of an answered pair taken at random: armed, as the pair's
// answer left it ("notes=node": a busy node's notes), or not
// ("notes=stale": the worst case, each note the search reads costs a
// lookup, up to its bound; a node has such notes only where an answer did
// not find its pair's note, one written to the slot an early drop had
// emptied, until a search meets it; an object that does not arm its notes
// has only those, and "stale" is then run on it alone). With 1 or 15
// droppable pairs among hundreds of thousands the search, as conntrack's,
// almost never meets one: refused, mostly; with a quarter, it finds one
// nearly always (the fraction admitted is reported).
//
// The figures are the mean (ns/newflow) and the median of the new flows'
// times; x-conntrack is the median over conntrack's figure for the same
// condition (conntrackBench: a table of nf_conntrack_max entries, 262 144
// here, with 0, 1, 15 or a quarter of its entries unanswered), measured
// right after in the same sub-benchmark. With -bpf.baseline, the old
// object's figures too.
//
//	go test -run '^$' -bench NewFlowFullTable -benchtime 20x -count 3 ./bpf/
func BenchmarkNewFlowFullTable(b *testing.B) {
	ct := newConntrackBench(b)
	for _, entries := range []int{1 << 16, 1 << 19, 1 << 20} {
		for _, d := range []int{0, 1, 15, quarter} {
			for _, armed := range []bool{true, false} {
				name := fmt.Sprint(d)
				if d == quarter {
					name = "quarter"
				}
				notes, run := "node", benchObjects
				if !armed {
					notes, run = "stale", benchCurrent
				}
				b.Run(fmt.Sprintf("entries=%d/droppable=%s/notes=%s", entries, name, notes), func(b *testing.B) {
					run(b, envOptions{natMax: uint32(entries), portMin: 1024, portMax: 65535}, func(b *testing.B, e *testEnv) {
						times, admitted := newFlowFullTableNs(b, e, entries, d, armed)
						ctNs := ct.newFlowNs(b, d)
						b.ReportMetric(mean(times), "ns/newflow")
						b.ReportMetric(median(times), "median-ns/newflow")
						b.ReportMetric(admitted, "admitted")
						b.ReportMetric(ctNs, "conntrack-ns/newflow")
						b.ReportMetric(median(times)/ctNs, "x-conntrack")
					})
				})
			}
		}
	}
}

// benchCurrent runs bench on the embedded build only (a condition an
// older build has no other form of).
func benchCurrent(b *testing.B, o envOptions, bench func(b *testing.B, e *testEnv)) {
	b.Run("current", func(b *testing.B) { bench(b, newEnv(b, o)) })
}

// quarter is the droppable count of the condition where a quarter of the
// table's pairs may go.
const quarter = -1

// newFlowFullTableNs fills e's IPv4 table, its answered pairs' notes
// armed or not, and returns the in-kernel times of b.N new flows (ns), and
// the fraction admitted.
func newFlowFullTableNs(b *testing.B, e *testEnv, entries, droppable int, armed bool) ([]float64, float64) {
	if droppable == quarter {
		fillEstablished(b, e, entries/2-entries/8)
		fillUnanswered(b, e, entries/8)
	} else {
		fillEstablished(b, e, entries/2-droppable)
		for i := range droppable {
			f := flow{src: pod1, dst: remote4, proto: protoUDP, sport: uint16(30000 + i), dport: 53, payload: []byte("q")}
			if ret, _ := e.run(e.dp.Egress, f.packet()); ret != tcActUnspec {
				b.Fatalf("droppable pair %d refused", i)
			}
		}
	}
	if e.dp.Maps.NatCandV4 != nil && e.dp.Maps.NatCandV4.MaxEntries() > natOldCandSlots {
		answeredNotes(b, e, armed)
	}
	var times []float64
	admitted := 0
	// One new flow first, not counted: the first program run after the
	// fill (millions of map updates from user space) finds the program's
	// code, its per-CPU state and the page tables' upper levels cold and
	// costs several times the next ones, which conntrack's figure (a mean
	// over 10 000 datagrams sent back to back) never includes.
	for i := -1; i < b.N; i++ {
		if e.dp.Maps.NatCandV4 == nil && droppable == 0 {
			time.Sleep(110 * time.Millisecond) // the map walk's backoff: measure its search
		}
		f := flow{src: pod1, dst: netip.AddrFrom4([4]byte{198, 51, byte(i >> 8), byte(i)}), proto: protoUDP, sport: 40000, dport: 53, payload: []byte("q")}
		ret, perRun, err := e.dp.Egress.Benchmark(f.packet(), 1, nil)
		if err != nil {
			b.Fatal(err)
		}
		if droppable == 0 && ret != tcActShot {
			b.Fatalf("new flow %d with %d droppable: verdict %d", i, droppable, int32(ret))
		}
		if i < 0 {
			continue
		}
		if ret == tcActUnspec {
			admitted++
		}
		times = append(times, float64(perRun.Nanoseconds()))
	}
	return times, float64(admitted) / float64(b.N)
}

// natOldCandSlots is the ring's size before the notes by hash: an object
// with a ring this size (-bpf.baseline) is measured as it is.
const natOldCandSlots = 4096

// fillUnanswered writes n unanswered UDP pairs from 10.0.6.0/24 into
// nat_v4, as the programs would have made them, stamped now, each noted at
// a slot of its own drawn at random.
func fillUnanswered(tb testing.TB, e *testEnv, n int) {
	tb.Helper()
	keys := make([]NATKeyV4, 0, 2*n)
	vals := make([]NATValV4, 0, 2*n)
	slots := e.dp.Maps.NatCandV4.MaxEntries()
	var nk []uint32
	var nv []NATCandV4
	now := monoNow()
	// Each note at a slot of its own drawn at random, as a hash places
	// them: notes at even distances would put the same number of them in
	// every window of adjacent slots a search reads.
	perm := rand.New(rand.NewPCG(3, 4)).Perm(int(slots))
	for i := range n {
		src := netip.AddrFrom4([4]byte{10, 0, 6, byte(i / 60000)})
		port := uint16(1024 + i%60000)
		dst := netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)})
		out := NATKeyV4{Src: Addr4(src), Dst: Addr4(dst), Sport: Port(port), Dport: Port(53), Proto: protoUDP, Dir: DirEgress}
		in := NATKeyV4{Src: Addr4(dst), Dst: Addr4(snat4), Sport: Port(53), Dport: Port(port), Proto: protoUDP, Dir: DirIngress}
		keys = append(keys, out, in)
		vals = append(vals, NATValV4{Addr: Addr4(snat4), Port: Port(port), LastSeenNs: now, CreatedNs: now},
			NATValV4{Addr: Addr4(src), Port: Port(port), LastSeenNs: now, CreatedNs: now})
		nk = append(nk, uint32(perm[i]))
		nv = append(nv, NATCandV4{Key: in, CreatedNs: now})
	}
	writeFillV4(tb, e, keys, vals, nk, nv)
}

// answeredNotes writes a note of an established pair (the filler's reply
// keys), armed with its stamp or not (stale), into every empty slot of the
// IPv4 notes.
func answeredNotes(b testing.TB, e *testEnv, armed bool) {
	var (
		k     NATKeyV4
		v     NATValV4
		stale []NATCandV4
	)
	slots := int(e.dp.Maps.NatCandV4.MaxEntries())
	it := e.dp.Maps.NatV4.Iterate()
	for len(stale) < slots && it.Next(&k, &v) {
		if k.Dir == DirIngress && v.Flags&NATFlagSeen != 0 {
			c := NATCandV4{Key: k, CreatedNs: v.CreatedNs}
			if armed {
				c.CreatedNs = v.LastSeenNs | noteArmed
			}
			stale = append(stale, c)
		}
	}
	if len(stale) == 0 {
		b.Fatal("no established pair to note")
	}
	// In the map's order the keys are those of neighbouring buckets:
	// neighbouring slots (a search's window) would hold keys whose lookups
	// share cache lines, which the hash-placed notes of a node never do.
	rnd := rand.New(rand.NewPCG(1, 2))
	rnd.Shuffle(len(stale), func(i, j int) { stale[i], stale[j] = stale[j], stale[i] })
	keys := make([]uint32, slots)
	cur := make([]NATCandV4, slots)
	var cursor ebpf.MapBatchCursor
	n, err := e.dp.Maps.NatCandV4.BatchLookup(&cursor, keys, cur, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		b.Fatal(err)
	}
	var wk []uint32
	var wv []NATCandV4
	for i := range n {
		if cur[i].CreatedNs == 0 {
			wk = append(wk, keys[i])
			wv = append(wv, stale[i%len(stale)])
		}
	}
	for i := 0; i < len(wk); i += 1 << 16 {
		j := min(i+1<<16, len(wk))
		if _, err := e.dp.Maps.NatCandV4.BatchUpdate(wk[i:j], wv[i:j], nil); err != nil {
			b.Fatal(err)
		}
	}
}

// conntrackBench measures how much longer a new UDP flow's sendto takes
// at a full conntrack table than in a namespace without conntrack: the
// same-run baseline of BenchmarkNewFlowFullTable, measured next to each of
// its figures (the machine's load moves both). The table's namespace has a
// MASQUERADE rule; its table is filled once with established, assured TCP
// entries (conntrack's early drop never takes them) but its last quarter
// (from 10.97.0.0/16), written per condition: 0, 1 or 15 unanswered UDP
// entries among established ones, or all unanswered (quarter). The other
// namespace has a rule at the same hooks that does what conntrack does to
// the packet (DROP at OUTPUT where conntrack refuses it, ACCEPT at OUTPUT
// and POSTROUTING where it admits it), so both take the datagram as far,
// and the hooks' fixed cost is taken off (the figure is conservative).
// Each sendto is timed alone, one datagram from one socket to a new
// destination port each, the two namespaces alternating in rounds; the
// figure is the difference of the medians (an interrupt or a preemption
// moves a mean, not a median).
type conntrackBench struct {
	max                       int
	full, refusing, admitting netns.NsHandle
	handle                    *netlink.Handle
	table                     *ctfill.Table
	dst                       netip.Addr
	condition                 int // the droppable count the tail holds
	port                      int // the last new flow's destination port
}

// noCondition: the tail holds no condition's entries yet.
const noCondition = -2

func newConntrackBench(b *testing.B) *conntrackBench {
	b.Helper()
	c := &conntrackBench{condition: noCondition, port: 1, dst: netip.AddrFrom4([4]byte{10, 99, 0, 2})}
	c.full, c.handle = ctNetns(b, "MASQUERADE")
	c.refusing, _ = ctNetns(b, "DROP")
	c.admitting, _ = ctNetns(b, "ACCEPT")
	c.table = ctfill.Open(b, c.full)
	_, c.max = c.table.Count(b)
	for i := range c.max - c.tail() {
		c.table.Established(b, c.from(98, i), netip.AddrPortFrom(c.dst, 443))
	}
	if count, _ := c.table.Count(b); count != c.max-c.tail() {
		b.Fatalf("conntrack: %d entries after writing %d", count, c.max-c.tail())
	}
	return c
}

func (c *conntrackBench) tail() int { return c.max / 4 }

// from is the source of the filler's i-th entry, in 10.<net>.0.0/16.
func (c *conntrackBench) from(net byte, i int) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, net, byte(i >> 16), byte(i >> 8)}), uint16(1024+i%60000))
}

// setCondition writes the tail for droppable (quarter: all of it
// unanswered), and takes away the flows the last measure admitted.
func (c *conntrackBench) setCondition(b *testing.B, droppable int) {
	if c.condition == droppable {
		return
	}
	for _, from := range []*net.IPNet{
		{IP: net.IPv4(10, 97, 0, 0), Mask: net.CIDRMask(16, 32)},
		{IP: net.IPv4(10, 99, 0, 1), Mask: net.CIDRMask(32, 32)},
	} {
		filter := &netlink.ConntrackFilter{}
		if err := filter.AddIPNet(netlink.ConntrackOrigSrcIP, from); err != nil {
			b.Fatal(err)
		}
		if _, err := c.handle.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, filter); err != nil {
			b.Fatal(err)
		}
	}
	for i := range c.tail() {
		if droppable == quarter || i < droppable {
			c.table.Unanswered(b, c.from(97, i), netip.AddrPortFrom(c.dst, 53))
		} else {
			c.table.Established(b, c.from(97, i), netip.AddrPortFrom(c.dst, 443))
		}
	}
	if count, _ := c.table.Count(b); count != c.max {
		b.Fatalf("conntrack: %d entries, not full (%d)", count, c.max)
	}
	c.condition = droppable
}

// newFlowNs is conntrack's figure for a new flow with droppable
// unanswered entries in the table (quarter: a quarter of it).
func (c *conntrackBench) newFlowNs(b *testing.B, droppable int) float64 {
	c.setCondition(b, droppable)
	// What conntrack does with a new flow here: refuse it (at most a few
	// early drops among thousands), or admit it.
	reference, admits := c.refusing, false
	if droppable == quarter {
		reference, admits = c.admitting, true
	}
	const n, rounds = 1000, 4
	var withCT, without []float64
	sent := 0
	for range rounds {
		times, ok := sendNewFlows(b, c.full, c.dst, &c.port, n)
		withCT, sent = append(withCT, times...), sent+ok
		times, _ = sendNewFlows(b, reference, c.dst, &c.port, n)
		without = append(without, times...)
	}
	if admitted := float64(sent) / float64(n*rounds); admits != (admitted > 0.5) {
		b.Fatalf("conntrack, %d droppable: %.2f of the new flows admitted", droppable, admitted)
	}
	ns := median(withCT) - median(without)
	b.Logf("conntrack, %d entries, %d droppable (-1: a quarter): sendto %.0f ns with the table, %.0f ns with the reference rule: %.0f ns a new flow (medians; %d of %d admitted)",
		c.max, droppable, median(withCT), median(without), ns, sent, n*rounds)
	return ns
}

// ctNetns makes a namespace with veth0 (10.99.0.1/24, up, its peer up,
// 10.99.0.2 a permanent neighbour) and rules out of it: MASQUERADE (nat
// POSTROUTING: conntrack then tracks every packet), DROP (mangle OUTPUT)
// or ACCEPT (mangle OUTPUT and POSTROUTING); the last two need no
// conntrack.
func ctNetns(b *testing.B, target string) (netns.NsHandle, *netlink.Handle) {
	ns, h := newNetns(b)
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "veth0"}, PeerName: "veth1"}); err != nil {
		b.Fatal(err)
	}
	l, err := h.LinkByName("veth0")
	if err != nil {
		b.Fatal(err)
	}
	peer, err := h.LinkByName("veth1")
	if err != nil {
		b.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("10.99.0.1/24")
	if err := h.AddrAdd(l, addr); err != nil {
		b.Fatal(err)
	}
	for _, link := range []netlink.Link{l, peer} {
		if err := h.LinkSetUp(link); err != nil {
			b.Fatal(err)
		}
	}
	if err := h.NeighAdd(&netlink.Neigh{LinkIndex: l.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_PERMANENT,
		IP: net.IPv4(10, 99, 0, 2), HardwareAddr: net.HardwareAddr{2, 0, 0, 0, 0, 2}}); err != nil {
		b.Fatal(err)
	}
	rules := map[string][][]string{
		"MASQUERADE": {{"-t", "nat", "-A", "POSTROUTING", "-o", "veth0", "-j", "MASQUERADE"}},
		"DROP":       {{"-t", "mangle", "-A", "OUTPUT", "-j", "DROP"}},
		"ACCEPT":     {{"-t", "mangle", "-A", "OUTPUT", "-j", "ACCEPT"}, {"-t", "mangle", "-A", "POSTROUTING", "-j", "ACCEPT"}},
	}[target]
	err = inNetns(ns, func() error {
		for _, r := range rules {
			if out, err := exec.Command("iptables-nft", r...).CombinedOutput(); err != nil {
				return fmt.Errorf("iptables-nft %v: %v: %s", r, err, out)
			}
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	return ns, h
}

// sendNewFlows sends n UDP datagrams from one socket in ns, each to a new
// destination port of dst (a new flow each), and returns each sendto's
// time (ns) and how many were sent (a refused one returns EPERM).
func sendNewFlows(b *testing.B, ns netns.NsHandle, dst netip.Addr, port *int, n int) ([]float64, int) {
	times := make([]float64, 0, n)
	sent := 0
	err := inNetns(ns, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		msg := []byte("q")
		for range n {
			*port = *port%60000 + 1
			sa := &unix.SockaddrInet4{Port: 1024 + *port, Addr: dst.As4()}
			start := time.Now()
			err := unix.Sendto(fd, msg, 0, sa)
			times = append(times, float64(time.Since(start).Nanoseconds()))
			if err == nil {
				sent++
			}
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	return times, sent
}

func newNetns(b *testing.B) (netns.NsHandle, *netlink.Handle) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		b.Fatal(err)
	}
	defer orig.Close()
	ns, err := netns.New()
	if err != nil {
		b.Fatal(err)
	}
	if err := netns.Set(orig); err != nil {
		panic(fmt.Sprintf("restore netns: %v", err))
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { h.Close(); ns.Close() })
	return ns, h
}

// inNetns runs fn on a thread in ns.
func inNetns(ns netns.NsHandle, fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		return err
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			panic(fmt.Sprintf("restore netns: %v", err))
		}
	}()
	return fn()
}

// writeFillV4 writes a fill's pairs into nat_v4, in batches, and its notes
// into nat_cand_v4.
func writeFillV4(tb testing.TB, e *testEnv, keys []NATKeyV4, vals []NATValV4, nk []uint32, nv []NATCandV4) {
	tb.Helper()
	for i := 0; i < len(keys); i += 8192 {
		j := min(i+8192, len(keys))
		if _, err := e.dp.Maps.NatV4.BatchUpdate(keys[i:j], vals[i:j], nil); err != nil {
			tb.Fatalf("fill: %v", err)
		}
	}
	if _, err := e.dp.Maps.NatCandV4.BatchUpdate(nk, nv, nil); err != nil {
		tb.Fatalf("notes: %v", err)
	}
}

// mean of v.
func mean(v []float64) float64 {
	var sum float64
	for _, x := range v {
		sum += x
	}
	return sum / float64(len(v))
}
