package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// A config change applies to new flows: Linux decides NAT once per
// conntrack entry, and a running flow keeps the source it started with
// (issue #22, item 9). The tests change the decision for the remote
// 203.0.113.10 (2001:db8:ff::10) under running flows: in the node's
// iptables (a RETURN before MASQUERADE) for the reference, in the agent's
// config file for ipmasq.

// logPort is the port of ext's one-way UDP sink (a syslog or statsd
// collector: it never answers).
const logPort = 5514

// remoteNonMasqConfig makes the remote a non-masquerade destination.
const remoteNonMasqConfig = "nonMasqueradeCIDRs: [203.0.113.10/32, 2001:db8:ff::10/128]\nmasqLinkLocal: true\nmasqLinkLocalIPv6: true\n"

// setRemoteMasqueraded makes new flows to the remotes masqueraded or not,
// while the masquerader runs.
func setRemoteMasqueraded(t *testing.T, s *scenario, masq bool) {
	t.Helper()
	if s.agent != nil {
		if masq {
			s.agent.writeConfig(masqueradeAll)
			s.agent.waitMaps("nonmasq_v4 169.254.0.0/16 no-masquerade\nnonmasq_v6 fe80::/10 no-masquerade\n")
		} else {
			s.agent.writeConfig(remoteNonMasqConfig)
			s.agent.waitMaps("nonmasq_v4 203.0.113.10/32 no-masquerade\nnonmasq_v6 2001:db8:ff::10/128 no-masquerade\n")
		}
		return
	}
	for _, dst := range []netip.Addr{topology.RemoteIP4, topology.RemoteIP6} {
		args := []string{"-t", "nat", "-I", "POSTROUTING", "1", "-d", dst.String(), "-j", "RETURN"}
		if masq {
			args = []string{"-t", "nat", "-D", "POSTROUTING", "-d", dst.String(), "-j", "RETURN"}
		}
		if err := s.topo.Node.Iptables(dst.Is6(), args...); err != nil {
			t.Fatal(err)
		}
	}
}

// udpSink counts the datagrams it receives by their first word (the
// sender's tag) and source address.
type udpSink struct {
	mu   sync.Mutex
	seen map[string]map[netip.Addr]int
}

func startUDPSink(t *testing.T, n *topology.Netns) *udpSink {
	t.Helper()
	s := &udpSink{seen: map[string]map[netip.Addr]int{}}
	var c net.PacketConn
	if err := n.Do(func() (err error) { c, err = net.ListenPacket("udp", fmt.Sprintf("[::]:%d", logPort)); return err }); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			m, from, err := c.ReadFrom(buf)
			if err != nil {
				return
			}
			tag, _, _ := strings.Cut(string(buf[:m]), " ")
			src := from.(*net.UDPAddr).AddrPort().Addr().Unmap()
			s.mu.Lock()
			if s.seen[tag] == nil {
				s.seen[tag] = map[netip.Addr]int{}
			}
			s.seen[tag][src]++
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() { c.Close(); <-done })
	return s
}

// from returns how many datagrams tagged tag came from each source.
func (s *udpSink) from(tag string) map[netip.Addr]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[netip.Addr]int{}
	for a, n := range s.seen[tag] {
		out[a] = n
	}
	return out
}

// waitFrom waits until the sink holds at least n datagrams tagged tag from
// src, and fails at once when any came from another source.
func (s *udpSink) waitFrom(t *testing.T, tag string, src netip.Addr, n int, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := s.from(tag)
		for a, k := range got {
			if a != src {
				t.Fatalf("%s: %d datagram(s) of %s came from %s, want every one from %s (seen: %v)", what, k, tag, a, src, got)
			}
		}
		if got[src] >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d datagrams of %s from %s, want %d", what, got[src], tag, src, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// udpStream sends tagged datagrams from one pod socket every 5 ms until
// stopped: a one-way flow (syslog, statsd).
type udpStream struct {
	stopped atomic.Bool
	done    chan error
}

func startUDPStream(t *testing.T, pod *topology.Netns, sport uint16, dst netip.Addr, tag string) *udpStream {
	t.Helper()
	var c *net.UDPConn
	err := pod.Do(func() (err error) {
		c, err = net.DialUDP("udp", &net.UDPAddr{Port: int(sport)}, net.UDPAddrFromAddrPort(netip.AddrPortFrom(dst, logPort)))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	s := &udpStream{done: make(chan error, 1)}
	go func() {
		defer c.Close()
		for i := 0; !s.stopped.Load(); i++ {
			if _, err := fmt.Fprintf(c, "%s %d", tag, i); err != nil {
				s.done <- fmt.Errorf("datagram %d of %s: %w", i, tag, err)
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		s.done <- nil
	}()
	t.Cleanup(func() { s.stopped.Store(true) })
	return s
}

func (s *udpStream) stop(t *testing.T) {
	t.Helper()
	s.stopped.Store(true)
	if err := <-s.done; err != nil {
		t.Fatal(err)
	}
}

// dialSourceFrom connects from the pod's source port sport to the TCP
// server on dst and returns what the server saw.
func dialSourceFrom(pod *topology.Netns, sport uint16, dst netip.Addr) (net.Conn, string, error) {
	return topology.DialSourceFrom(pod, sport, netip.AddrPortFrom(dst, tcpPort))
}

// TestConfigChangeKeepsRunningFlows: the remote's decision changes while
// flows to it run, each family, both ways: non-masquerade to masquerade
// (the running flows keep the pod's address: the watcher allows exactly
// them) and masquerade to non-masquerade (they keep the node's; the watcher
// allows only the new flows). The running flows are a one-way UDP stream,
// or a TCP stream. A flow started after the change gets the new decision.
func TestConfigChangeKeepsRunningFlows(t *testing.T) {
	for _, c := range []struct {
		name      string
		masqFirst bool
	}{{"non-masquerade-to-masquerade", false}, {"masquerade-to-non-masquerade", true}} {
		for _, proto := range []string{"udp-one-way", "tcp-stream"} {
			t.Run(c.name+"/"+proto, func(t *testing.T) {
				config := remoteNonMasqConfig
				if c.masqFirst {
					config = masqueradeAll
				}
				spec := setupSpec{config: config, sources: podSources, beforeStart: func(t *testing.T, topo *topology.Masquerade) {
					// ext answers pod addresses (the non-masquerade flows)
					if err := topo.RouteBack(); err != nil {
						t.Fatal(err)
					}
				}}
				underBoth(t, spec, func(t *testing.T, s *scenario) {
					decisionKept(t, s, c.masqFirst, proto == "tcp-stream")
				})
			})
		}
	}
}

// decisionKept runs one running flow per family (a TCP stream, or a
// one-way UDP stream), changes the remote's decision, and checks the
// running flows and new ones.
func decisionKept(t *testing.T, s *scenario, masqFirst, tcp bool) {
	if s.agent == nil && !masqFirst {
		setRemoteMasqueraded(t, s, false)
	}
	sink := startUDPSink(t, s.topo.Ext)
	type family struct {
		name           string
		dst, pod, node netip.Addr
		run, new       uint16 // source ports: the running flow, a flow started after the change
		udp            *udpStream
		tcp            *stream
		before, after  netip.Addr // the source before and after the change
	}
	fams := []*family{
		{name: "v4", dst: topology.RemoteIP4, pod: topology.PodIP4, node: topology.NodeIP4, run: 41000, new: 41001},
		{name: "v6", dst: topology.RemoteIP6, pod: topology.PodIP6, node: topology.NodeIP6, run: 41010, new: 41011},
	}
	proto := byte(unix.IPPROTO_UDP)
	if tcp {
		proto = unix.IPPROTO_TCP
	}
	for _, f := range fams {
		f.before, f.after = f.pod, f.node
		if masqFirst {
			f.before, f.after = f.node, f.pod
			s.leaks.allow(f.dst, proto, f.new)
		} else {
			s.leaks.allow(f.dst, proto, f.run)
		}
		if !tcp {
			f.udp = startUDPStream(t, s.topo.Pod, f.run, f.dst, "run-"+f.name)
			continue
		}
		conn, seen, err := dialSourceFrom(s.topo.Pod, f.run, f.dst)
		if err != nil {
			t.Fatal(err)
		}
		if seen != f.before.String() {
			conn.Close()
			t.Fatalf("%s: TCP stream started from %s, want %s", f.name, seen, f.before)
		}
		f.tcp = newStream(conn)
	}
	for _, f := range fams {
		if tcp {
			f.tcp.progress(t, 16<<10, "before the change")
		} else {
			sink.waitFrom(t, "run-"+f.name, f.before, 20, "before the change")
		}
	}

	setRemoteMasqueraded(t, s, !masqFirst)

	for _, f := range fams {
		if tcp {
			f.tcp.progress(t, 256<<10, "after the change")
			c, seen, err := dialSourceFrom(s.topo.Pod, f.new, f.dst)
			if err != nil {
				t.Fatal(err)
			}
			c.Close()
			if seen != f.after.String() {
				t.Fatalf("%s: a new TCP flow after the change came from %s, want %s", f.name, seen, f.after)
			}
			continue
		}
		// 100 more datagrams: half a second of the stream after the change
		n := sink.from("run-" + f.name)[f.before]
		sink.waitFrom(t, "run-"+f.name, f.before, n+100, "after the change")
		ns := startUDPStream(t, s.topo.Pod, f.new, f.dst, "new-"+f.name)
		sink.waitFrom(t, "new-"+f.name, f.after, 5, "a new UDP flow after the change")
		ns.stop(t)
	}
	for _, f := range fams {
		if tcp {
			f.tcp.progress(t, 16<<10, "at the end")
			f.tcp.stop(t)
			t.Logf("%s: TCP stream kept %s; a new flow from %s", f.name, f.before, f.after)
			continue
		}
		f.udp.stop(t)
		got := sink.from("run-" + f.name)
		if len(got) != 1 {
			t.Fatalf("%s: the one-way stream's datagrams came from %v, want all from %s", f.name, got, f.before)
		}
		t.Logf("%s: one-way stream %d datagrams, all from %s; a new flow from %s", f.name, got[f.before], f.before, f.after)
	}
}
