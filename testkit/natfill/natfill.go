// Package natfill fills the datapath's NAT maps, and a conntrack table in a
// namespace of its own, with idle flows at scale: the two sides of the
// benchmarks of the NAT state's cost at 50 000 to 1 000 000 flows (nat -C,
// a scrape, the listing, the collector's idle CPU; docs/benchmarks.md).
package natfill

import (
	"net/netip"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/testkit/ctfill"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// Sizes are the flow counts of the benchmarks.
var Sizes = []int{50_000, 200_000, 500_000, 1_000_000}

// ConntrackMax is the most conntrack entries a test can make: the table is
// capped by nf_conntrack_max, which only the host's own namespace may
// raise (262 144 here) and a test may not change. The conntrack side of a
// larger size is measured at this many entries.
const ConntrackMax = 250_000

// Now is the clock of bpf_ktime_get_ns.
func Now() uint64 { return bpf.KtimeNow() }

// Datapath loads the datapath with its maps pinned in a private bpffs,
// nat_v4 sized for flows pairs, and fills nat_v4 with flows answered TCP
// pairs last seen idle ago (both entries each, 60 000 NAT ports toward each
// of flows/60 000 remotes), written directly in batches (the programs would
// take minutes to make a million), with the programs' counts set to match.
func Datapath(tb testing.TB, flows int, idle time.Duration) (*bpf.Datapath, bpf.Pinned) {
	tb.Helper()
	privtest.Require(tb)
	dir := filepath.Join(privtest.MountBPFFS(tb), "ipmasq")
	dp, err := bpf.Load(bpf.LoadOptions{PinDir: dir, NATMaxEntriesV4: uint32(2*flows + 1024), NATMaxEntriesV6: 1024})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { dp.Close() })
	if err := dp.SetLifetimes(bpf.DefaultLifetimes); err != nil {
		tb.Fatal(err)
	}
	seen := Now() - uint64(idle)
	const chunk = 1 << 16
	keys := make([]bpf.NATKeyV4, 0, chunk)
	vals := make([]bpf.NATValV4, 0, chunk)
	snat := bpf.Addr4(netip.MustParseAddr("10.0.0.5"))
	for i := range flows {
		pod := netip.AddrFrom4([4]byte{10, 244, byte(i >> 16), byte(i >> 8)})
		remote := netip.AddrFrom4([4]byte{198, 18, byte(i / 60000), 7})
		k := bpf.NATKeyV4{Src: bpf.Addr4(pod), Dst: bpf.Addr4(remote),
			Sport: bpf.Port(uint16(1024 + i%60000)), Dport: bpf.Port(443), Proto: bpf.ProtoTCP, Dir: bpf.DirEgress}
		v := bpf.NATValV4{Addr: snat, Port: bpf.Port(uint16(1024 + i%60000)), CreatedNs: seen, LastSeenNs: seen}
		keys, vals = append(keys, k, bpf.PeerV4(k, v)), append(vals, v, bpf.NATValV4{Addr: k.Src, Port: k.Sport,
			Flags: bpf.NATFlagSeen, CreatedNs: seen, LastSeenNs: seen})
		if len(keys) >= chunk || i == flows-1 {
			if _, err := dp.Maps.NatV4.BatchUpdate(keys, vals, nil); err != nil {
				tb.Fatal(err)
			}
			keys, vals = keys[:0], vals[:0]
		}
	}
	c, err := bpf.CountNATEntries(dp.Maps.NatV4, false)
	if err == nil {
		err = bpf.SetNATCounts(dp.Maps.NatCount, c)
	}
	if err != nil {
		tb.Fatal(err)
	}
	if c.Masquerade != flows || c.Reply != flows {
		tb.Fatalf("nat_v4 holds %+v, want %d pairs", c, flows)
	}
	return dp, bpf.Pinned{Dir: dir}
}

// Conntrack makes a network namespace with min(n, ConntrackMax) idle UDP
// conntrack entries (created over ctnetlink, an hour to live) and returns
// it with the number made.
func Conntrack(tb testing.TB, n int) (netns.NsHandle, int) {
	tb.Helper()
	n = min(n, ConntrackMax)
	ns, _ := privtest.NewNetns(tb)
	table := ctfill.Open(tb, ns)
	for i := range n {
		src := netip.AddrFrom4([4]byte{10, 244, byte(i >> 16), byte(i >> 8)})
		dst := netip.AddrFrom4([4]byte{198, 18, byte(i / 60000), 7})
		sport, dport := uint16(1024+i%60000), uint16(443)
		f := conntrack.NewFlow(unix.IPPROTO_UDP, conntrack.StatusConfirmed, src, dst, sport, dport, ctfill.Lifetime, 0)
		f.TupleReply.IP.DestinationAddress = netip.AddrFrom4([4]byte{10, 0, 0, 5}) // masqueraded
		table.Write(tb, f)
	}
	if count, _ := table.Count(tb); count != n {
		tb.Fatalf("conntrack holds %d entries after %d were written", count, n)
	}
	return ns, n
}

// Compare runs ours (over flows flows) and baseline (over entries
// conntrack entries) alternately b.N times each and reports the mean of
// each (ms/op of each side) and their ratio (ours/baseline), measured in
// the same run under the same load; where the baseline has fewer entries
// (capped at ConntrackMax) and the figure grows with them (perEntry: a
// listing), the ratio is per entry.
func Compare(b *testing.B, flows, entries int, perEntry bool, ours, baseline func() error) {
	b.Helper()
	// The setup's garbage (a million conntrack entries made over netlink)
	// is collected before, not during, the timed rounds.
	runtime.GC()
	var tOurs, tBase time.Duration
	for i := 0; b.Loop(); i++ {
		for _, side := range []struct {
			fn  func() error
			sum *time.Duration
		}{{ours, &tOurs}, {baseline, &tBase}} {
			start := time.Now()
			if err := side.fn(); err != nil {
				b.Fatal(err)
			}
			*side.sum += time.Since(start)
		}
	}
	n := float64(b.N)
	b.ReportMetric(tOurs.Seconds()*1e3/n, "ms-ipmasq/op")
	b.ReportMetric(tBase.Seconds()*1e3/n, "ms-conntrack/op")
	ratio := tOurs.Seconds() / tBase.Seconds()
	if perEntry {
		ratio *= float64(entries) / float64(flows)
	}
	b.ReportMetric(ratio, "ratio")
	b.ReportMetric(float64(entries), "conntrack-entries")
}
