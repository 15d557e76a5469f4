package natview

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// pinnedNAT loads the datapath with its maps pinned in a private bpffs and
// returns it with the pin directory the listing reads.
func pinnedNAT(tb testing.TB, maxEntries uint32) (*bpf.Datapath, bpf.Pinned) {
	tb.Helper()
	privtest.Require(tb)
	dir := filepath.Join(privtest.MountBPFFS(tb), "ipmasq")
	dp, err := bpf.Load(bpf.LoadOptions{PinDir: dir, NATMaxEntries: maxEntries})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { dp.Close() })
	if err := dp.SetLifetimes(bpf.DefaultLifetimes); err != nil {
		tb.Fatal(err)
	}
	return dp, bpf.Pinned{Dir: dir}
}

// setCounts makes the programs' counts (nat_count) those of a walk of the
// NAT maps, which the test wrote directly, past the programs.
func setCounts(tb testing.TB, dp *bpf.Datapath) {
	tb.Helper()
	for i, m := range []*ebpf.Map{dp.Maps.NatV4, dp.Maps.NatV6} {
		c, err := bpf.CountNATEntries(m, i == 1)
		if err == nil {
			err = bpf.SetNATCounts(dp.Maps.NatCount, c)
		}
		if err != nil {
			tb.Fatal(err)
		}
	}
}

// pairV4 returns both entries of pod → remote translated to snat:natPort,
// created and last seen at the given monotonic times, with egress and
// reply flags.
func pairV4(proto uint8, pod, remote, snat netip.AddrPort, created, seen uint64, outFlags, inFlags uint8) (
	[]bpf.NATKeyV4, []bpf.NATValV4) {
	k := bpf.NATKeyV4{Src: bpf.Addr4(pod.Addr()), Dst: bpf.Addr4(remote.Addr()), Sport: bpf.Port(pod.Port()),
		Dport: bpf.Port(remote.Port()), Proto: proto, Dir: bpf.DirEgress}
	v := bpf.NATValV4{Addr: bpf.Addr4(snat.Addr()), Port: bpf.Port(snat.Port()), Flags: outFlags, CreatedNs: created, LastSeenNs: seen}
	rk := bpf.PeerV4(k, v)
	rv := bpf.NATValV4{Addr: k.Src, Port: k.Sport, Flags: inFlags, CreatedNs: created, LastSeenNs: seen}
	return []bpf.NATKeyV4{k, rk}, []bpf.NATValV4{v, rv}
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// TestListKnownFlows: the listing of a NAT map holding known flows (a TCP
// pair answered, a UDP pair not, an inbound flow, a node socket's hold, a
// pair whose reply entry was evicted, an IPv6 pair) shows each with its
// state, age, expiry and tuples; the filters, JSON, summary and count agree.
func TestListKnownFlows(t *testing.T) {
	dp, pinned := pinnedNAT(t, 1024)
	now := bpf.KtimeNow()
	ago := func(d time.Duration) uint64 { return now - uint64(d) }
	var keys []bpf.NATKeyV4
	var vals []bpf.NATValV4
	add := func(k []bpf.NATKeyV4, v []bpf.NATValV4) { keys, vals = append(keys, k...), append(vals, v...) }
	// Created 10.3 s ago, last packet 2.3 s ago, answered: established.
	add(pairV4(bpf.ProtoTCP, ap("10.244.1.2:40000"), ap("198.51.100.7:443"), ap("10.0.0.5:40000"),
		ago(10300*time.Millisecond), ago(2300*time.Millisecond), 0, bpf.NATFlagSeen))
	// A UDP query not answered, 5.3 s idle: 30 s - 5 s left.
	add(pairV4(bpf.ProtoUDP, ap("10.244.1.3:5353"), ap("198.51.100.8:53"), ap("10.0.0.5:61001"),
		ago(5300*time.Millisecond), ago(5300*time.Millisecond), 0, 0))
	// A TCP pair whose reply entry was evicted: only the egress half.
	k, v := pairV4(bpf.ProtoTCP, ap("10.244.1.4:41000"), ap("198.51.100.9:80"), ap("10.0.0.5:41000"),
		ago(3300*time.Millisecond), ago(300*time.Millisecond), bpf.NATFlagFIN, 0)
	add(k[:1], v[:1])
	// A remote opened 203.0.113.9:50000 → pod 10.244.1.2:80, answered.
	keys = append(keys, bpf.NATKeyV4{Src: bpf.Addr4(netip.MustParseAddr("10.244.1.2")), Dst: bpf.Addr4(netip.MustParseAddr("203.0.113.9")),
		Sport: bpf.Port(80), Dport: bpf.Port(50000), Proto: bpf.ProtoTCP, Dir: bpf.DirInbound})
	vals = append(vals, bpf.NATValV4{Flags: bpf.NATFlagSeen, CreatedNs: ago(60300 * time.Millisecond), LastSeenNs: ago(300 * time.Millisecond)})
	// A node socket 10.0.0.5:61500 → 198.51.100.10:53 holds its reply tuple.
	keys = append(keys, bpf.NATKeyV4{Src: bpf.Addr4(netip.MustParseAddr("198.51.100.10")), Dst: bpf.Addr4(netip.MustParseAddr("10.0.0.5")),
		Sport: bpf.Port(53), Dport: bpf.Port(61500), Proto: bpf.ProtoUDP, Dir: bpf.DirIngress})
	vals = append(vals, bpf.NATValV4{Flags: bpf.NATFlagHost, CreatedNs: ago(1300 * time.Millisecond), LastSeenNs: ago(1300 * time.Millisecond)})
	if _, err := dp.Maps.NatV4.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
	// An IPv6 pair, established and closing (FIN from the pod).
	k6 := bpf.NATKeyV6{Src: netip.MustParseAddr("fd00:10:244:1::2").As16(), Dst: netip.MustParseAddr("2001:db8:1::7").As16(),
		Sport: bpf.Port(42000), Dport: bpf.Port(443), Proto: bpf.ProtoTCP, Dir: bpf.DirEgress}
	v6 := bpf.NATValV6{Addr: netip.MustParseAddr("2001:db8::5").As16(), Port: bpf.Port(42000), Flags: bpf.NATFlagFIN,
		CreatedNs: ago(20300 * time.Millisecond), LastSeenNs: ago(300 * time.Millisecond)}
	if err := dp.Maps.NatV6.Put(k6, v6); err != nil {
		t.Fatal(err)
	}
	if err := dp.Maps.NatV6.Put(bpf.PeerV6(k6, v6), bpf.NATValV6{Addr: k6.Src, Port: k6.Sport, Flags: bpf.NATFlagSeen,
		CreatedNs: v6.CreatedNs, LastSeenNs: v6.LastSeenNs}); err != nil {
		t.Fatal(err)
	}

	setCounts(t, dp)

	list := func(args ...string) string {
		t.Helper()
		var b bytes.Buffer
		if err := Run(&b, pinned, args); err != nil {
			t.Fatalf("nat %v: %v", args, err)
		}
		return b.String()
	}
	sorted := func(s string) string {
		lines := strings.SplitAfter(s, "\n")
		slices.Sort(lines)
		return strings.Join(lines, "")
	}
	want := `host ipv4 udp udp age=1s expires=28s 10.0.0.5:61500 -> 198.51.100.10:53
inbound ipv4 tcp tcp-established age=1m0s expires=119h59m59s 203.0.113.9:50000 -> 10.244.1.2:80
masquerade ipv4 tcp tcp-closing age=3s expires=1m59s 10.244.1.4:41000 -> 198.51.100.9:80 as 10.0.0.5:41000 reply-entry-evicted
masquerade ipv4 tcp tcp-established age=10s expires=119h59m57s 10.244.1.2:40000 -> 198.51.100.7:443 as 10.0.0.5:40000
masquerade ipv4 udp udp age=5s expires=24s 10.244.1.3:5353 -> 198.51.100.8:53 as 10.0.0.5:61001
masquerade ipv6 tcp tcp-closing age=20s expires=1m59s [fd00:10:244:1::2]:42000 -> [2001:db8:1::7]:443 as [2001:db8::5]:42000
`
	if got := sorted(list()); got != want {
		t.Errorf("nat:\n%s\nwant:\n%s", got, want)
	}

	for _, tc := range []struct {
		args []string
		want []string // the original sources listed
	}{
		{[]string{"--proto", "udp"}, []string{"10.0.0.5:61500", "10.244.1.3:5353"}},
		{[]string{"--proto", "udp", "--kind", "masquerade"}, []string{"10.244.1.3:5353"}},
		{[]string{"--state", "tcp-established"}, []string{"10.244.1.2:40000", "203.0.113.9:50000"}},
		{[]string{"--src", "10.244.1.0/24"}, []string{"10.244.1.2:40000", "10.244.1.3:5353", "10.244.1.4:41000"}},
		{[]string{"--src", "fd00:10:244:1::2"}, []string{"[fd00:10:244:1::2]:42000"}},
		{[]string{"--dst", "198.51.100.8"}, []string{"10.244.1.3:5353"}},
		{[]string{"--port", "61001"}, []string{"10.244.1.3:5353"}}, // the translated port
		{[]string{"--port", "443"}, []string{"10.244.1.2:40000", "[fd00:10:244:1::2]:42000"}},
		{[]string{"--kind", "inbound"}, []string{"203.0.113.9:50000"}},
		{[]string{"--proto", "sctp"}, nil},
	} {
		var got []string
		for line := range strings.Lines(list(tc.args...)) {
			got = append(got, strings.Fields(line)[6])
		}
		slices.Sort(got)
		if !slices.Equal(got, tc.want) {
			t.Errorf("nat %v: sources %v, want %v", tc.args, got, tc.want)
		}
	}

	var pairs []jsonPair
	if err := json.Unmarshal([]byte(list("-o", "json", "--src", "10.244.1.2")), &pairs); err != nil {
		t.Fatal(err)
	}
	if len(pairs) != 1 || pairs[0].Translated == nil || pairs[0].Translated.Src != ap("10.0.0.5:40000") ||
		pairs[0].Original.Dst != ap("198.51.100.7:443") || pairs[0].State != "tcp-established" ||
		!slices.Equal(pairs[0].Flags, []string{"answered"}) || pairs[0].AgeSeconds < 10 || pairs[0].AgeSeconds > 11 {
		t.Errorf("-o json --src 10.244.1.2: %+v", pairs)
	}
	if got := list("-o", "json", "--proto", "sctp"); strings.TrimSpace(got) != "[]" {
		t.Errorf("-o json of no pair: %q, want []", got)
	}

	if got := list("--count"); got != "6\n" {
		t.Errorf("--count: %q", got)
	}
	if got := list("-C", "--kind", "host"); got != "1\n" {
		t.Errorf("-C --kind host: %q", got)
	}
	if got := list("-C", "--kind", "masquerade", "--proto", "tcp"); got != "3\n" {
		t.Errorf("-C --kind masquerade --proto tcp: %q", got)
	}
	summary := list("--summary")
	for _, want := range []string{
		"ipv4           7      1024   0.7%\n", // 3 pairs × 2 - 1 evicted + inbound + host
		"ipv6           2      1024   0.2%\n",
		"masquerade ipv4   tcp      tcp-established          1\n",
		"masquerade ipv4   tcp      tcp-closing              1\n",
		"masquerade ipv6   tcp      tcp-closing              1\n",
		"inbound    ipv4   tcp      tcp-established          1\n",
		"host       ipv4   udp      udp                      1\n",
		"total                                               6\n",
	} {
		if !strings.Contains(summary, want) {
			t.Errorf("--summary lacks %q:\n%s", want, summary)
		}
	}
	var sj struct {
		Maps  []bpf.NATMapFill
		Pairs int
	}
	if err := json.Unmarshal([]byte(list("-S", "-o", "json")), &sj); err != nil || sj.Pairs != 6 ||
		!slices.Equal(sj.Maps, []bpf.NATMapFill{{Family: "ipv4", Entries: 7, Capacity: 1024}, {Family: "ipv6", Entries: 2, Capacity: 1024}}) {
		t.Errorf("-S -o json: %+v %v", sj, err)
	}
}

// TestBadOptions: each bad option is refused before anything is read,
// naming the flag and what it accepts.
func TestBadOptions(t *testing.T) {
	for args, want := range map[string]string{
		"--proto=tcpx":      `--proto="tcpx": want tcp, udp, icmp, icmpv6, sctp or an IP protocol number (0-255)`,
		"--state=open":      `--state="open": want one of tcp-syn, tcp-established, tcp-closing, tcp-reset, udp, udp-stream, icmp, other`,
		"--src=10.0.0.300":  `--src="10.0.0.300": want an address or a prefix`,
		"--dst=10.0.0.0/33": `--dst="10.0.0.0/33": want an address or a prefix`,
		"-o=yaml":           `--output="yaml": want text or json`,
		"--kind=snat":       `--kind="snat": want masquerade, inbound or host`,
		"-S -C":             "--summary and --count: choose one",
		"--port=70000":      `invalid argument "70000" for "--port"`,
	} {
		err := Run(&bytes.Buffer{}, bpf.Pinned{Dir: "/nonexistent"}, strings.Fields(args))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", args, err, want)
		}
	}
	if err := Run(&bytes.Buffer{}, bpf.Pinned{Dir: "/nonexistent"}, nil); err == nil || !strings.Contains(err.Error(), "not pinned") {
		t.Errorf("no maps: %v", err)
	}
}

// countsOnly is a Source whose pairs cannot be read: --count must answer
// from the datapath's counts.
type countsOnly struct{ counts []bpf.NATCounts }

func (c countsOnly) NATPairs(func(*bpf.NATPair) bool) error {
	return errors.New("the pairs were read")
}
func (c countsOnly) Lifetimes() (bpf.Lifetimes, error)   { return bpf.DefaultLifetimes, nil }
func (c countsOnly) NATFill() ([]bpf.NATMapFill, error)  { return nil, errors.New("the fill was read") }
func (c countsOnly) NATCounts() ([]bpf.NATCounts, error) { return c.counts, nil }

// TestCountReadsTheCounts: nat -C, alone or with --kind, is the datapath's
// count (conntrack -C), whatever the size of the maps; another filter
// reads the pairs.
func TestCountReadsTheCounts(t *testing.T) {
	src := countsOnly{[]bpf.NATCounts{{Family: "ipv4", Masquerade: 500000, Reply: 499990, Inbound: 7, Host: 2},
		{Family: "ipv6", Masquerade: 3, Reply: 3, Inbound: 1}}}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-C"}, "500013\n"},
		{[]string{"--count", "--kind", "masquerade"}, "500003\n"},
		{[]string{"-C", "--kind", "inbound"}, "8\n"},
		{[]string{"-C", "--kind", "host"}, "2\n"},
	} {
		var b bytes.Buffer
		if err := Run(&b, src, c.args); err != nil || b.String() != c.want {
			t.Errorf("nat %v: %q, %v; want %q", c.args, b.String(), err, c.want)
		}
	}
	if err := Run(io.Discard, src, []string{"-C", "--proto", "tcp"}); err == nil {
		t.Error("nat -C --proto tcp did not read the pairs")
	}
}
