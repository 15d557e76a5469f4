package ipam

import (
	"errors"
	"math"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

func mustPools(t testing.TB, cidrs ...string) *Pools {
	t.Helper()
	var ps []netip.Prefix
	for _, c := range cidrs {
		ps = append(ps, netip.MustParsePrefix(c))
	}
	p, err := NewPools(ps)
	if err != nil {
		t.Fatalf("NewPools(%v): %v", cidrs, err)
	}
	return p
}

// usedSet is the allocator's view of the endpoints table.
type usedSet map[netip.Addr]bool

func (u usedSet) used(ip netip.Addr) bool { return u[ip] }

// alloc takes the next address and marks it used.
func (u usedSet) alloc(t *testing.T, p *Pools, f tables.Family) netip.Addr {
	t.Helper()
	ip, err := p.Next(f, u.used)
	if err != nil {
		t.Fatalf("Next(%s): %v", f, err)
	}
	if u[ip] {
		t.Fatalf("Next(%s) returned %s, which is in use", f, ip)
	}
	if !p.Usable(ip) {
		t.Fatalf("Next(%s) returned %s, which is not usable", f, ip)
	}
	u[ip] = true
	return ip
}

func addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func TestNewPoolsValidation(t *testing.T) {
	tests := []struct {
		cidrs []string
		want  string // substring of the error; "" means valid
	}{
		{[]string{"10.244.1.0/24", "fd00:10:244:1::/64"}, ""},
		{[]string{"10.244.1.0/30"}, ""},
		{[]string{"fd00::/126"}, ""},
		{nil, ""},
		{[]string{"10.244.1.1/24"}, "--pod-cidr 10.244.1.1/24 has host bits set; did you mean 10.244.1.0/24?"},
		{[]string{"fd00::1/64"}, "--pod-cidr fd00::1/64 has host bits set; did you mean fd00::/64?"},
		{[]string{"10.244.0.0/16", "10.244.1.0/24"}, "--pod-cidr 10.244.1.0/24 overlaps --pod-cidr 10.244.0.0/16"},
		{[]string{"10.244.1.0/24", "10.244.1.0/24"}, "overlaps"},
		{[]string{"10.244.1.0/31"}, "--pod-cidr 10.244.1.0/31 is too small: an IPv4 pool must be /30 or larger"},
		{[]string{"10.244.1.1/32"}, "too small"},
		{[]string{"fd00::/127"}, "--pod-cidr fd00::/127 is too small: an IPv6 pool must be /126 or larger"},
		{[]string{"::ffff:10.244.1.0/120"}, "IPv4-mapped IPv6 prefix; write it as IPv4: 10.244.1.0/24"},
	}
	for _, tt := range tests {
		var ps []netip.Prefix
		for _, c := range tt.cidrs {
			ps = append(ps, netip.MustParsePrefix(c))
		}
		_, err := NewPools(ps)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("NewPools(%v): unexpected error %v", tt.cidrs, err)
		case tt.want != "" && err == nil:
			t.Errorf("NewPools(%v): no error, want %q", tt.cidrs, tt.want)
		case tt.want != "" && !strings.Contains(err.Error(), tt.want):
			t.Errorf("NewPools(%v): error %q, want it to contain %q", tt.cidrs, err, tt.want)
		}
	}

	if _, err := NewPools([]netip.Prefix{{}}); err == nil || !strings.Contains(err.Error(), "not a valid prefix") {
		t.Errorf("NewPools(zero prefix): error %v, want 'not a valid prefix'", err)
	}
}

func TestPrefixes(t *testing.T) {
	p := mustPools(t, "10.244.2.0/24", "fd00::/64", "10.244.1.0/24")
	if got, want := p.Prefixes(tables.IPv4), []netip.Prefix{
		netip.MustParsePrefix("10.244.2.0/24"), netip.MustParsePrefix("10.244.1.0/24"),
	}; !slices.Equal(got, want) {
		t.Errorf("Prefixes(ipv4) = %v, want %v (in the order given)", got, want)
	}
	if got := p.Prefixes(tables.IPv6); len(got) != 1 || got[0] != netip.MustParsePrefix("fd00::/64") {
		t.Errorf("Prefixes(ipv6) = %v, want [fd00::/64]", got)
	}
}

func TestExhaustSlash30(t *testing.T) {
	// .0 network, .1 gateway, .3 broadcast: .2 is the one usable address.
	p := mustPools(t, "10.244.1.0/30")
	u := usedSet{}
	got := []netip.Addr{u.alloc(t, p, tables.IPv4)}
	if want := addrs("10.244.1.2"); !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v", got, want)
	}
	_, err := p.Next(tables.IPv4, u.used)
	if !errors.Is(err, ErrExhausted) {
		t.Fatalf("second Next: %v, want ErrExhausted", err)
	}
	if want := "ipv4 pools 10.244.1.0/30 exhausted: all 1 addresses are allocated"; err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
}

func TestExhaustSlash29(t *testing.T) {
	p := mustPools(t, "10.244.1.0/29")
	u := usedSet{}
	var got []netip.Addr
	for range 5 {
		got = append(got, u.alloc(t, p, tables.IPv4))
	}
	want := addrs("10.244.1.2", "10.244.1.3", "10.244.1.4", "10.244.1.5", "10.244.1.6")
	if !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v", got, want)
	}
	if _, err := p.Next(tables.IPv4, u.used); !errors.Is(err, ErrExhausted) {
		t.Fatalf("sixth Next: %v, want ErrExhausted", err)
	}
	// Exhaustion is not sticky: a release makes room again.
	delete(u, netip.MustParseAddr("10.244.1.4"))
	if ip := u.alloc(t, p, tables.IPv4); ip != netip.MustParseAddr("10.244.1.4") {
		t.Errorf("after releasing 10.244.1.4 got %s", ip)
	}
}

func TestNextFitWrapsAround(t *testing.T) {
	p := mustPools(t, "10.244.1.0/29")
	u := usedSet{}
	for range 5 {
		u.alloc(t, p, tables.IPv4)
	}
	// The cursor is at .6, the end of the pool. Free .2 and .5: nothing is
	// after .6, so the search wraps to .2, then goes on from there to .5.
	delete(u, netip.MustParseAddr("10.244.1.2"))
	delete(u, netip.MustParseAddr("10.244.1.5"))
	got := []netip.Addr{u.alloc(t, p, tables.IPv4), u.alloc(t, p, tables.IPv4)}
	if want := addrs("10.244.1.2", "10.244.1.5"); !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v", got, want)
	}

	// Cursor at .5: free .3 and .6; .6 is after the cursor, so it comes
	// before .3.
	delete(u, netip.MustParseAddr("10.244.1.3"))
	delete(u, netip.MustParseAddr("10.244.1.6"))
	got = []netip.Addr{u.alloc(t, p, tables.IPv4), u.alloc(t, p, tables.IPv4)}
	if want := addrs("10.244.1.6", "10.244.1.3"); !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v", got, want)
	}
}

func TestReleasedAddressNotReusedAtOnce(t *testing.T) {
	p := mustPools(t, "10.244.1.0/29")
	u := usedSet{}
	a1, _, a3 := u.alloc(t, p, tables.IPv4), u.alloc(t, p, tables.IPv4), u.alloc(t, p, tables.IPv4)
	delete(u, a3) // the most recent one, where the cursor is
	delete(u, a1)
	got := []netip.Addr{u.alloc(t, p, tables.IPv4), u.alloc(t, p, tables.IPv4), u.alloc(t, p, tables.IPv4)}
	if want := addrs("10.244.1.5", "10.244.1.6", "10.244.1.2"); !slices.Equal(got, want) {
		t.Fatalf("after releasing %s and %s allocated %v, want %v", a1, a3, got, want)
	}
	// Only with the pool's end reached did a released address return
	// (a1, the oldest position); the just-released a3 comes last.
	got = []netip.Addr{u.alloc(t, p, tables.IPv4)}
	if want := []netip.Addr{a3}; !slices.Equal(got, want) {
		t.Fatalf("then allocated %v, want %v", got, want)
	}

	// When the just-released address is the only free one, it is handed out.
	delete(u, a3)
	if ip := u.alloc(t, p, tables.IPv4); ip != a3 {
		t.Errorf("with only %s free got %s", a3, ip)
	}
}

func TestNextAcrossPools(t *testing.T) {
	p := mustPools(t, "10.244.2.0/30", "fd00::/126", "10.244.1.0/30")
	u := usedSet{}
	var got []netip.Addr
	for range 2 {
		got = append(got, u.alloc(t, p, tables.IPv4))
	}
	if want := addrs("10.244.2.2", "10.244.1.2"); !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v (pools in the order given)", got, want)
	}
	_, err := p.Next(tables.IPv4, u.used)
	if want := "ipv4 pools 10.244.2.0/30, 10.244.1.0/30 exhausted: all 2 addresses are allocated"; err == nil || err.Error() != want {
		t.Fatalf("error %v, want %q", err, want)
	}

	// Wrap-around from the last pool back to the first.
	delete(u, netip.MustParseAddr("10.244.2.2"))
	if ip := u.alloc(t, p, tables.IPv4); ip != netip.MustParseAddr("10.244.2.2") {
		t.Errorf("got %s, want 10.244.2.2", ip)
	}

	// IPv6 is independent: /126 has ::2 and ::3 (::1 is the gateway).
	got = nil
	for range 2 {
		got = append(got, u.alloc(t, p, tables.IPv6))
	}
	if want := addrs("fd00::2", "fd00::3"); !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v", got, want)
	}
	if _, err := p.Next(tables.IPv6, u.used); !errors.Is(err, ErrExhausted) {
		t.Fatalf("third ipv6 Next: %v, want ErrExhausted", err)
	}
}

func TestNextNoPool(t *testing.T) {
	p := mustPools(t, "10.244.1.0/24")
	_, err := p.Next(tables.IPv6, usedSet{}.used)
	if !errors.Is(err, ErrNoPool) {
		t.Fatalf("Next(ipv6) with IPv4 pools only: %v, want ErrNoPool", err)
	}
	if want := "no pool for ipv6 addresses: --pod-cidr has only 10.244.1.0/24"; err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
	_, err = mustPools(t).Next(tables.IPv4, usedSet{}.used)
	if want := "no pool for ipv4 addresses: no --pod-cidr is configured"; err == nil || err.Error() != want {
		t.Errorf("error %v, want %q", err, want)
	}
}

func TestNextIPv6Slash64(t *testing.T) {
	p := mustPools(t, "fd00:10:244:1::/64")
	u := usedSet{}
	start := time.Now()
	for i := range 10000 {
		ip := u.alloc(t, p, tables.IPv6)
		if i == 0 && ip != netip.MustParseAddr("fd00:10:244:1::2") {
			t.Fatalf("first address %s, want fd00:10:244:1::2 (::1 is the gateway)", ip)
		}
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("10000 allocations from a /64 took %v", d)
	}

	// Everything in use: Next must give up, not scan 2^64 addresses.
	start = time.Now()
	_, err := p.Next(tables.IPv6, func(netip.Addr) bool { return true })
	if !errors.Is(err, ErrExhausted) {
		t.Fatalf("Next with all in use: %v, want ErrExhausted", err)
	}
	if !strings.Contains(err.Error(), "the search stops after 1048576 per pool") {
		t.Errorf("error %q does not say the search is bounded", err)
	}
	t.Logf("bounded scan gave up in %v: %v", time.Since(start), err)

	// The cursor at the very top of the address space must not wrap to ::.
	top := mustPools(t, "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffc/126")
	u = usedSet{}
	var got []netip.Addr
	for range 2 {
		got = append(got, u.alloc(t, top, tables.IPv6))
	}
	want := addrs("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")
	if !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v", got, want)
	}
	delete(u, want[0])
	if ip := u.alloc(t, top, tables.IPv6); ip != want[0] {
		t.Errorf("after wrap got %s, want %s", ip, want[0])
	}
}

func TestUsableAndContains(t *testing.T) {
	p := mustPools(t, "10.244.1.0/24", "fd00::/64")
	tests := []struct {
		ip               string
		contains, usable bool
	}{
		{"10.244.1.0", true, false},   // network
		{"10.244.1.1", true, false},   // gateway
		{"10.244.1.2", true, true},    // first usable
		{"10.244.1.254", true, true},  // last usable
		{"10.244.1.255", true, false}, // broadcast
		{"10.244.2.1", false, false},
		{"10.244.0.255", false, false},
		{"::ffff:10.244.1.1", false, false}, // IPv4-mapped: not an endpoint address
		{"fd00::", true, false},             // network (subnet-router anycast)
		{"fd00::1", true, false},            // gateway
		{"fd00::2", true, true},
		{"fd00::ffff:ffff:ffff:ffff", true, true}, // IPv6 has no broadcast
		{"fd00:0:0:1::1", false, false},
		{"fe80::1", false, false},
	}
	for _, tt := range tests {
		ip := netip.MustParseAddr(tt.ip)
		if got := p.Contains(ip); got != tt.contains {
			t.Errorf("Contains(%s) = %v, want %v", ip, got, tt.contains)
		}
		if got := p.Usable(ip); got != tt.usable {
			t.Errorf("Usable(%s) = %v, want %v", ip, got, tt.usable)
		}
	}
}

func TestCapacity(t *testing.T) {
	tests := []struct {
		cidrs  []string
		v4, v6 uint64
	}{
		{[]string{"10.244.1.0/24"}, 253, 0},
		{[]string{"10.244.1.0/30", "10.244.2.0/29"}, 6, 0},
		{[]string{"10.0.0.0/8"}, 1<<24 - 3, 0},
		{[]string{"fd00::/126"}, 0, 2},
		{[]string{"fd00::/120", "10.244.1.0/24"}, 253, 254},
		{[]string{"fd00::/64"}, 0, math.MaxUint64},
		{[]string{"fd00::/64", "fd01::/64"}, 0, math.MaxUint64},
		{[]string{"fd00::/48"}, 0, math.MaxUint64},
	}
	for _, tt := range tests {
		p := mustPools(t, tt.cidrs...)
		if got := p.Capacity(tables.IPv4); got != tt.v4 {
			t.Errorf("%v: Capacity(ipv4) = %d, want %d", tt.cidrs, got, tt.v4)
		}
		if got := p.Capacity(tables.IPv6); got != tt.v6 {
			t.Errorf("%v: Capacity(ipv6) = %d, want %d", tt.cidrs, got, tt.v6)
		}
	}
}

// BenchmarkNext allocates from a /16 with 10 000 addresses in use.
// "first" is the worst case: a fresh allocator (as after a restart) must
// pass all 10 000 to find a free one. "steady" is next-fit at work: churn
// with the cursor past the used block.
func BenchmarkNext(b *testing.B) {
	prefix := []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}
	fill := func() usedSet {
		u := usedSet{}
		ip := netip.MustParseAddr("10.244.0.1")
		for range 10000 {
			u[ip] = true
			ip = ip.Next()
		}
		return u
	}

	b.Run("first", func(b *testing.B) {
		u := fill()
		for b.Loop() {
			p, _ := NewPools(prefix)
			if _, err := p.Next(tables.IPv4, u.used); err != nil {
				b.Fatal(err)
			}
		}
	})

	b.Run("steady", func(b *testing.B) {
		u := fill()
		p, _ := NewPools(prefix)
		var ring []netip.Addr
		if _, err := p.Next(tables.IPv4, u.used); err != nil { // move the cursor past the block
			b.Fatal(err)
		}
		for b.Loop() {
			ip, err := p.Next(tables.IPv4, u.used)
			if err != nil {
				b.Fatal(err)
			}
			u[ip] = true
			ring = append(ring, ip)
			if len(ring) > 100 { // keep the used count near 10 000
				delete(u, ring[0])
				ring = ring[1:]
			}
		}
	})
}
