package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/ctfill"
)

// silentPort is a remote port nothing listens on: a pod's datagrams to it
// are never answered (ext's port unreachable is no answer: conntrack's
// entry stays unreplied, ipmasq's pair unanswered).
const silentPort = 7099

// TestFullTableFindsDroppable: the NAT table (--nat-max-entries=16384:
// 8 192 flows) is filled with unanswered UDP flows first (4 000, from
// fresh sockets), then with established TCP connections (4 192: more than
// the 4 096 notes of the ring the search had). New queries made
// right after are answered (95 % or more on their first datagram: each
// needs an early drop, which now finds a droppable pair wherever the
// table holds many), and every new query 10 s later; every TCP
// connection still answers, and no pod address reaches the wire. Then the
// same with the agent killed after the fill: the pinned programs keep
// running, and need nothing from it. The search used to see only the last
// 4 096 pairs noted: a table whose droppable pairs were made before many
// assured ones refused every new flow until the collector freed them, and
// forever with the agent down.
//
// The reference, Linux MASQUERADE on the same topology: its limit,
// nf_conntrack_max, is the host's (read-only in a network namespace), but
// the count it is checked against is the namespace's. So the node's
// conntrack table is first filled over ctnetlink up to that limit with
// entries of the same mix (half unreplied UDP, early-droppable; half
// established TCP, never), minus room for the scenario's own flows: its
// new queries then need conntrack's early drop too.
func TestFullTableFindsDroppable(t *testing.T) {
	for _, down := range []bool{false, true} {
		name := "agent running"
		if down {
			name = "agent killed after the fill"
		}
		t.Run(name, func(t *testing.T) { fullTableFindsDroppable(t, down) })
	}
}

func fullTableFindsDroppable(t *testing.T, agentDown bool) {
	const natMax, unanswered, queries = 16384, 4000, 100
	conns := natMax/2 - unanswered
	underBoth(t, masqueradePods(fmt.Sprintf("--nat-max-entries=%d", natMax)), func(t *testing.T, s *scenario) {
		var (
			table      *ctfill.Table
			earlyDrops uint64
		)
		if s.agent == nil {
			table = fillConntrack(t, s.topo.Node, unanswered+conns)
			earlyDrops = table.EarlyDrops(t)
		}
		for i := range unanswered {
			c, err := dialNewUDPFlow(s.topo.Pod, netip.AddrPortFrom(topology.RemoteIP4, silentPort))
			if err != nil {
				t.Fatal(err)
			}
			c.Write([]byte("unanswered"))
			c.Close()
			if i%20 == 19 {
				time.Sleep(10 * time.Millisecond)
			}
		}
		var est []net.Conn
		defer func() {
			for _, c := range est {
				c.Close()
			}
		}()
		for i := range conns {
			c, seen, err := dialTCP(s.topo.Pod, topology.RemoteIP4)
			if err != nil || seen != topology.NodeIP4.String() {
				t.Fatalf("connection %d of %d: seen as %q, %v%s", i+1, conns, seen, err, countersOf(s))
			}
			if i%100 == 0 {
				echoOnce(t, c, "established\n")
			}
			est = append(est, c)
		}
		if agentDown && s.agent != nil {
			s.agent.stop(syscall.SIGKILL)
		}
		ask := func(when string, min int) {
			t.Helper()
			answered := 0
			var last error
			for range queries {
				seen, err := udpAsk(s.topo.Pod, topology.RemoteIP4, 1, time.Second)
				switch {
				case err != nil:
					last = err
				case seen != topology.NodeIP4.String():
					t.Fatalf("query %s: seen as %q", when, seen)
				default:
					answered++
				}
			}
			t.Logf("%s: %d of %d queries answered on their first datagram", when, answered, queries)
			if answered < min {
				t.Fatalf("%s: %d of %d queries answered (last error %v), want %d or more%s", when, answered, queries, last, min, countersOf(s))
			}
		}
		ask("right after the fill", queries*95/100)
		time.Sleep(10 * time.Second)
		ask("10 s later", queries)
		for i, c := range est {
			echoOnce(t, c, fmt.Sprintf("connection %d after the queries\n", i))
		}
		t.Logf("%d established connections answered after the queries", len(est))
		if a := s.agent; a != nil {
			if n := a.counter(bpf.CounterNATEarlyDrop); n == 0 {
				t.Fatalf("no early drop: the table was not full%s", countersOf(s))
			}
		} else if n := table.EarlyDrops(t) - earlyDrops; n == 0 {
			t.Fatal("no early drop by conntrack: its table was not full, and the reference proves nothing")
		} else {
			t.Logf("conntrack's early drop took %d entries", n)
		}
	})
}

// countersOf is the agent's counters for a failure message ("" under
// MASQUERADE).
func countersOf(s *scenario) string {
	if s.agent == nil {
		return ""
	}
	return "\n" + s.agent.counters()
}

// fillConntrack fills ns's conntrack table over ctnetlink up to
// nf_conntrack_max less room entries: half unreplied UDP entries (early
// drop may take them), half established, assured TCP ones (it never
// does), from 10.96.0.0/12 to a TEST-NET address, an hour to live. It
// returns the table.
func fillConntrack(t *testing.T, ns *topology.Netns, room int) *ctfill.Table {
	t.Helper()
	table := ctfill.Open(t, ns.Handle)
	_, max := table.Count(t)
	dst := netip.AddrFrom4([4]byte{192, 0, 2, 1})
	start := time.Now()
	n := max - room
	for i := range n {
		src := netip.AddrFrom4([4]byte{10, 96 + byte(i>>16), byte(i >> 8), byte(i)})
		if i%2 == 1 {
			table.Established(t, netip.AddrPortFrom(src, 1024), netip.AddrPortFrom(dst, 443))
		} else {
			table.Unanswered(t, netip.AddrPortFrom(src, 1024), netip.AddrPortFrom(dst, 53))
		}
	}
	if count, _ := table.Count(t); count != n {
		t.Fatalf("conntrack holds %d entries after %d were written", count, n)
	}
	t.Logf("conntrack filled with %d entries (limit %d) in %s", n, max, time.Since(start).Round(time.Millisecond))
	return table
}
