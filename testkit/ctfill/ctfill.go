// Package ctfill writes entries into a network namespace's conntrack table
// over ctnetlink, as the benchmarks and the MASQUERADE references of the
// end-to-end tests need them, and reads the table's count and early drops
// back.
//
// The status is written with the entry: one made over ctnetlink without
// IPS_ASSURED is one that conntrack's early drop may take, whatever its
// TCP state (vishvananda/netlink's ConntrackCreate sends no status, and
// sends an IPv4 address in the 16-byte form net.IPv4 returns, of which
// the kernel reads the first 4 bytes: 0.0.0.0).
package ctfill

import (
	"net/netip"
	"testing"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Lifetime is every written entry's lifetime, in seconds: longer than any
// test.
const Lifetime = 3600

// tcpEstablished is TCP_CONNTRACK_ESTABLISHED.
const tcpEstablished = 3

// Table is a namespace's conntrack table.
type Table struct {
	conn *conntrack.Conn
}

// Open opens ns's table; it is closed with tb.
func Open(tb testing.TB, ns netns.NsHandle) *Table {
	tb.Helper()
	conn, err := conntrack.Dial(&netlink.Config{NetNS: int(ns)})
	if err != nil {
		tb.Fatalf("ctnetlink: %v", err)
	}
	tb.Cleanup(func() { conn.Close() })
	return &Table{conn: conn}
}

// Established writes an answered, assured, established TCP connection from
// src to dst: conntrack's early drop never takes it.
func (t *Table) Established(tb testing.TB, src, dst netip.AddrPort) {
	tb.Helper()
	f := t.flow(unix.IPPROTO_TCP, conntrack.StatusConfirmed|conntrack.StatusSeenReply|conntrack.StatusAssured, src, dst)
	f.ProtoInfo.TCP = &conntrack.ProtoInfoTCP{State: tcpEstablished}
	t.Write(tb, f)
}

// Unanswered writes a UDP flow from src to dst that no reply has reached:
// one conntrack's early drop may take.
func (t *Table) Unanswered(tb testing.TB, src, dst netip.AddrPort) {
	tb.Helper()
	t.Write(tb, t.flow(unix.IPPROTO_UDP, conntrack.StatusConfirmed, src, dst))
}

func (t *Table) flow(proto uint8, status conntrack.Status, src, dst netip.AddrPort) conntrack.Flow {
	return conntrack.NewFlow(proto, status, src.Addr(), dst.Addr(), src.Port(), dst.Port(), Lifetime, 0)
}

// Write writes f, an entry of any other shape (f.Timeout must be set).
func (t *Table) Write(tb testing.TB, f conntrack.Flow) {
	tb.Helper()
	if err := t.conn.Create(f); err != nil {
		tb.Fatalf("conntrack entry %v: %v", f.TupleOrig, err)
	}
}

// Count returns the number of entries in the table and the most it may
// hold (nf_conntrack_max: the host's, read-only in a namespace).
func (t *Table) Count(tb testing.TB) (entries, max int) {
	tb.Helper()
	s, err := t.conn.StatsGlobal()
	if err != nil {
		tb.Fatalf("conntrack's count: %v", err)
	}
	return int(s.Entries), int(s.MaxEntries)
}

// EarlyDrops returns how many entries conntrack's early drop has taken in
// the namespace, over all CPUs.
func (t *Table) EarlyDrops(tb testing.TB) uint64 {
	tb.Helper()
	stats, err := t.conn.Stats()
	if err != nil {
		tb.Fatalf("conntrack's statistics: %v", err)
	}
	var n uint64
	for _, s := range stats {
		n += uint64(s.EarlyDrop)
	}
	return n
}
