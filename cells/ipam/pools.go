package ipam

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/tables"
)

var (
	// ErrExhausted means every usable address of a family is allocated (or,
	// in a huge IPv6 pool, that the bounded scan found none free).
	ErrExhausted = errors.New("exhausted")
	// ErrNoPool means no --pod-cidr of the requested family is configured.
	ErrNoPool = errors.New("no pool")
)

// maxScanPerPool bounds how many candidates Next checks in one pool, so
// that a /64 cannot make it loop for ever. Reaching it needs that many
// addresses in use in a row, far more than a node runs.
const maxScanPerPool = 1 << 20

// Pools hands out endpoint addresses from the node's pod CIDRs.
//
// Pools is safe for concurrent use. Its only state besides the pools is
// where each family's last allocation was, which makes Next next-fit.
type Pools struct {
	v4, v6 family

	mu sync.Mutex
}

type family struct {
	pools []pool
	// cursor is the address Next returned last; guarded by Pools.mu.
	cursor netip.Addr
}

// pool is one --pod-cidr and its range of usable addresses.
type pool struct {
	prefix      netip.Prefix
	first, last netip.Addr
	size        uint64 // usable addresses, saturating
}

func (p *pool) holds(ip netip.Addr) bool {
	return p.prefix.Contains(ip) && ip.Compare(p.first) >= 0 && ip.Compare(p.last) <= 0
}

// NewPools makes the pools of cidrs, which tables.ValidatePools must
// accept. Pools of a family are searched in the order given.
func NewPools(cidrs []netip.Prefix) (*Pools, error) {
	if err := tables.ValidatePools(cidrs); err != nil {
		return nil, err
	}
	p := &Pools{}
	for _, c := range cidrs {
		fam := p.family(tables.FamilyOf(c.Addr()))
		fam.pools = append(fam.pools, newPool(c))
	}
	return p, nil
}

// newPool computes the usable range of a checked prefix: all but the
// network address and the first address (the pods' gateway by convention:
// the node's address on the pod side, as host-local and Cilium reserve
// it), and for IPv4 also all but the broadcast address.
func newPool(c netip.Prefix) pool {
	hostBits := c.Addr().BitLen() - c.Bits()
	pl := pool{prefix: c, first: c.Addr().Next().Next(), last: lastAddr(c)}
	switch {
	case c.Addr().Is4():
		pl.last = pl.last.Prev()
		pl.size = 1<<hostBits - 3
	case hostBits >= 64:
		pl.size = math.MaxUint64 // 2^64-2 for a /64, saturated like the larger ones
	default:
		pl.size = 1<<hostBits - 2
	}
	return pl
}

// lastAddr is the highest address of a masked prefix.
func lastAddr(c netip.Prefix) netip.Addr {
	b := c.Addr().As16()
	off := 16 - c.Addr().BitLen()/8 // IPv4 lives in the last 4 bytes
	for i := off*8 + c.Bits(); i < 128; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	if c.Addr().Is4() {
		return netip.AddrFrom4([4]byte(b[12:]))
	}
	return netip.AddrFrom16(b)
}

func (p *Pools) family(f tables.Family) *family {
	if f == tables.IPv6 {
		return &p.v6
	}
	return &p.v4
}

// Prefixes returns the pools of a family in the order they were given.
func (p *Pools) Prefixes(f tables.Family) []netip.Prefix {
	pools := p.family(f).pools
	out := make([]netip.Prefix, 0, len(pools))
	for _, pl := range pools {
		out = append(out, pl.prefix)
	}
	return out
}

// Contains reports whether ip lies in one of the pools. IPv4-mapped IPv6
// addresses are not in any pool: endpoints hold plain IPv4 addresses.
func (p *Pools) Contains(ip netip.Addr) bool {
	for _, pl := range p.family(tables.FamilyOf(ip)).pools {
		if pl.prefix.Contains(ip) {
			return true
		}
	}
	return false
}

// Usable reports whether ip may be handed out: inside a pool and not the
// pool's network address, its first address (the gateway), nor (IPv4) its
// broadcast address.
func (p *Pools) Usable(ip netip.Addr) bool {
	for _, pl := range p.family(tables.FamilyOf(ip)).pools {
		if pl.holds(ip) {
			return true
		}
	}
	return false
}

// Capacity is the number of usable addresses of a family, saturating at
// math.MaxUint64.
func (p *Pools) Capacity(f tables.Family) uint64 {
	var n uint64
	for _, pl := range p.family(f).pools {
		if n+pl.size < n {
			return math.MaxUint64
		}
		n += pl.size
	}
	return n
}

// Next returns a free usable address of family f, where used(ip) reports
// addresses already taken.
//
// The search is next-fit: it starts just after the address Next returned
// last, runs to the end of that pool, through the family's other pools in
// order, and wraps around back to the start. A just-released address is
// therefore handed out again only when nothing else is free, so a stale
// reference to it (a conntrack entry, a slow peer) does not meet a new
// owner at once. The cost is one used call per address in use that the
// search passes, and at most 1<<20 per pool: when that many in a row are
// in use in a huge IPv6 pool, Next gives up with ErrExhausted.
//
// used is called with the lock of p held; it must not call back into p.
func (p *Pools) Next(f tables.Family, used func(netip.Addr) bool) (netip.Addr, error) {
	fam := p.family(f)
	pools := fam.pools
	if len(pools) == 0 {
		return netip.Addr{}, p.errNoPool(f)
	}

	p.mu.Lock()
	defer p.mu.Unlock()

	start, from := 0, pools[0].first
	wrap := false // whether to come back to the start pool's beginning
	if c := fam.cursor; c.IsValid() {
		for i := range pools {
			if pools[i].holds(c) {
				start, from, wrap = i, c.Next(), true
				break
			}
		}
	}

	budget := make([]uint64, len(pools))
	for i := range pools {
		budget[i] = min(pools[i].size, maxScanPerPool)
	}
	scan := func(i int, lo, hi netip.Addr) (netip.Addr, bool) {
		// lo is invalid past the top of the IPv6 space (cursor was ::ffff...).
		for a := lo; budget[i] > 0 && a.IsValid() && a.Compare(hi) <= 0; a = a.Next() {
			budget[i]--
			if !used(a) {
				return a, true
			}
		}
		return netip.Addr{}, false
	}

	n := len(pools)
	for k := 0; k < n; k++ {
		i := (start + k) % n
		lo := pools[i].first
		if k == 0 {
			lo = from
		}
		if a, ok := scan(i, lo, pools[i].last); ok {
			fam.cursor = a
			return a, nil
		}
	}
	if wrap {
		// The start pool up to and including the last address returned:
		// if that was released, it is the last resort.
		if a, ok := scan(start, pools[start].first, fam.cursor); ok {
			fam.cursor = a
			return a, nil
		}
	}
	return netip.Addr{}, p.errExhausted(f, budget)
}

func (p *Pools) poolList(f tables.Family) string {
	var b strings.Builder
	for i, c := range p.Prefixes(f) {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(c.String())
	}
	return b.String()
}

func (p *Pools) errNoPool(f tables.Family) error {
	other := tables.IPv4
	if f == tables.IPv4 {
		other = tables.IPv6
	}
	if len(p.family(other).pools) == 0 {
		return fmt.Errorf("%w for %s addresses: no --pod-cidr is configured", ErrNoPool, f)
	}
	return fmt.Errorf("%w for %s addresses: --pod-cidr has only %s", ErrNoPool, f, p.poolList(other))
}

func (p *Pools) errExhausted(f tables.Family, budget []uint64) error {
	bounded := false
	var checked uint64
	for i, pl := range p.family(f).pools {
		bounded = bounded || pl.size > maxScanPerPool
		checked += min(pl.size, maxScanPerPool) - budget[i]
	}
	if !bounded {
		return fmt.Errorf("%s pools %s %w: all %d addresses are allocated",
			f, p.poolList(f), ErrExhausted, p.Capacity(f))
	}
	return fmt.Errorf("%s pools %s %w: the %d addresses checked are all allocated (the search stops after %d per pool)",
		f, p.poolList(f), ErrExhausted, checked, maxScanPerPool)
}

// poolsCache is the Pools of the pod-cidrs table's current pool ranges. It
// builds a new Pools only when the ranges change, so next-fit keeps its
// place between allocations.
type poolsCache struct {
	mu       sync.Mutex
	prefixes []netip.Prefix
	pools    *Pools
	// err is why the current ranges are not usable; the previous pools
	// stay in use.
	err error
}

// get returns the pools for the table's ranges as of txn. Ranges that do
// not form valid pools (overlapping pod CIDRs from two sources) leave the
// previous pools in use.
func (c *poolsCache) get(txn statedb.ReadTxn, tbl statedb.Table[*tables.PodCIDR]) *Pools {
	prefixes := tables.PoolPrefixes(txn, tbl)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pools != nil && slices.Equal(prefixes, c.prefixes) {
		return c.pools
	}
	c.prefixes = prefixes
	pools, err := NewPools(prefixes)
	c.err = err
	if err == nil {
		c.pools = pools
	}
	if c.pools == nil {
		c.pools = &Pools{}
	}
	return c.pools
}
