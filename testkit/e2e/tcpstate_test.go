package e2e

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// Connection state as conntrack keeps it (issue #32): a blind RST, a
// connection idle for hours, the fragments of a former masquerade source.
// Each scenario runs under Linux MASQUERADE first, then ipmasq.

// echoListener accepts one TCP connection on addr in n and echoes it; the
// source the server saw (the NAT address and port) comes on the channel.
func echoListener(t *testing.T, n *topology.Netns, addr netip.Addr) (netip.AddrPort, <-chan netip.AddrPort) {
	t.Helper()
	var l net.Listener
	if err := n.Do(func() (err error) {
		l, err = net.Listen("tcp", netip.AddrPortFrom(addr, 0).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	seen := make(chan netip.AddrPort, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		seen <- c.RemoteAddr().(*net.TCPAddr).AddrPort()
		io.Copy(c, c)
	}()
	return l.Addr().(*net.TCPAddr).AddrPort(), seen
}

// dialPod connects from the pod to dst and returns the connection and the
// NAT address and port the server saw.
func dialPod(t *testing.T, pod *topology.Netns, dst netip.AddrPort, seen <-chan netip.AddrPort) (net.Conn, netip.AddrPort) {
	t.Helper()
	var c net.Conn
	if err := pod.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", dst.String(), 3*time.Second)
		return err
	}); err != nil {
		t.Fatalf("connect to %s: %v", dst, err)
	}
	t.Cleanup(func() { c.Close() })
	select {
	case nat := <-seen:
		return c, nat
	case <-time.After(3 * time.Second):
		t.Fatal("the server accepted no connection")
	}
	return nil, netip.AddrPort{}
}

// sendRST sends, from n, a TCP RST from from to to with sequence number seq
// (a raw socket: an off-path sender that forges the server's address).
func sendRST(t *testing.T, n *topology.Netns, from, to netip.AddrPort, seq uint32) {
	t.Helper()
	h := make([]byte, 20)
	binary.BigEndian.PutUint16(h[0:], from.Port())
	binary.BigEndian.PutUint16(h[2:], to.Port())
	binary.BigEndian.PutUint32(h[4:], seq)
	h[12] = 5 << 4
	h[13] = 0x04 // RST
	var sum uint32
	for _, b := range [][]byte{from.Addr().AsSlice(), to.Addr().AsSlice(), {0, unix.IPPROTO_TCP, 0, 20}, h} {
		for i := 0; i < len(b); i += 2 {
			sum += uint32(b[i])<<8 | uint32(b[i+1])
		}
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	binary.BigEndian.PutUint16(h[16:], ^uint16(sum))
	err := n.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_TCP)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: from.Addr().As4()}); err != nil {
			return err
		}
		return unix.Sendto(fd, h, 0, &unix.SockaddrInet4{Addr: to.Addr().As4()})
	})
	if err != nil {
		t.Fatalf("send a RST from %s to %s: %v", from, to, err)
	}
}

// TestBlindRSTKeepsConnection: an off-path sender forges the server's
// address and sends the NAT address and port of a pod's established
// connection a RST with a sequence number nowhere near the connection's.
// Conntrack finds it out of window (invalid, so not translated, and the
// pair stays established): the connection carries on. Under ipmasq the
// pair ended (tcp-reset, 1 s here), the collector freed it, and the next
// segment was picked up on another NAT port, which the server reset.
func TestBlindRSTKeepsConnection(t *testing.T) {
	spec := masqueradePods("--nat-keep-source-port=false", "--nat-timeout-tcp-reset=1s", "--nat-gc-interval=300ms")
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		srv, seen := echoListener(t, s.topo.Ext, topology.RemoteIP4)
		conn, nat := dialPod(t, s.topo.Pod, srv, seen)
		if nat.Addr() != topology.NodeIP4 {
			t.Fatalf("the server saw %s", nat)
		}
		echoOnce(t, conn, "before the RST\n")
		sendRST(t, s.topo.Ext, srv, nat, 0x5eed0000)
		time.Sleep(2 * time.Second) // the reset lifetime and a collection
		for i := range 3 {
			echoOnce(t, conn, fmt.Sprintf("after a blind RST, %d\n", i))
		}
		if a := s.agent; a != nil && a.counter(bpf.CounterTCPRSTIgnored) == 0 {
			t.Errorf("the blind RST not counted in tcp-rst-ignored:\n%s", a.counters())
		}
	})
}

// TestIdlePooledConnectionSurvives: a pod's connection (a pooled one,
// keepalives off) stays idle for 7 hours. Conntrack keeps an established
// entry 5 days (the reference checks the entry's timeout is over 7 h
// after an exchange); ipmasq's pair is aged 7 h in the map and the
// collector runs: the connection carries on from the same NAT port. With
// the old 6 h lifetime the pair was collected, and the next segment was
// picked up on another port, which the server reset.
func TestIdlePooledConnectionSurvives(t *testing.T) {
	spec := masqueradePods("--nat-keep-source-port=false", "--nat-gc-interval=300ms")
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		srv, seen := echoListener(t, s.topo.Ext, topology.RemoteIP4)
		conn, nat := dialPod(t, s.topo.Pod, srv, seen)
		echoOnce(t, conn, "before the idle hours\n")
		if s.agent == nil {
			flows, err := s.topo.Node.NL.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
			if err != nil {
				t.Fatal(err)
			}
			found := false
			for _, f := range flows {
				if f.Forward.Protocol == unix.IPPROTO_TCP && f.Reverse.SrcPort == srv.Port() && f.Reverse.DstPort == nat.Port() {
					found = true
					if left := time.Duration(f.TimeOut) * time.Second; left < 7*time.Hour {
						t.Fatalf("conntrack keeps the idle connection %s, want more than 7 h", left)
					}
				}
			}
			if !found {
				t.Fatalf("no conntrack entry for the connection to %s from %s", srv, nat)
			}
		} else {
			ageNATPairs(t, s.agent, 7*time.Hour)
			time.Sleep(time.Second) // collections
		}
		echoOnce(t, conn, "after 7 idle hours\n")
	})
}

// ageNATPairs moves every IPv4 NAT entry's stamps d into the past, as if
// its flow had been idle that long.
func ageNATPairs(t *testing.T, a *agent, d time.Duration) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.bpfRoot, "ipmasq", bpf.MapNATV4), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	then := uint64(ts.Nano()) - uint64(d)
	var k bpf.NATKeyV4
	var v bpf.NATValV4
	var keys []bpf.NATKeyV4
	var vals []bpf.NATValV4
	for it := m.Iterate(); it.Next(&k, &v); {
		v.LastSeenNs, v.CreatedNs = then, then
		keys, vals = append(keys, k), append(vals, v)
	}
	for i := range keys {
		if err := m.Update(keys[i], vals[i], ebpf.UpdateExist); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRemovedSourceKeepsFragments: a tunnel client's UDP flow runs while
// its masquerade rule is removed; the flow keeps its translation (Linux
// keeps the conntrack entry's NAT), and so does its next datagram, sent
// in fragments: every fragment leaves from the node's address (the leak
// watcher fails the run on one with the client's), and the server answers
// the reassembled datagram. Before, the first fragment was translated and
// the others left with the client's address.
func TestRemovedSourceKeepsFragments(t *testing.T) {
	spec := setupSpec{
		client:  true,
		config:  "nonMasqueradeCIDRs: []\n" + wgRule,
		sources: []string{topology.ClientCIDR4, topology.ClientCIDR6},
	}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		flows := []struct {
			remote, node netip.Addr
			conn         net.Conn
		}{{remote: topology.RemoteIP4, node: topology.NodeIP4}, {remote: topology.RemoteIP6, node: topology.NodeIP6}}
		for i, c := range flows {
			if err := s.topo.Client.Do(func() (err error) {
				flows[i].conn, err = net.Dial("udp", netip.AddrPortFrom(c.remote, udpPort).String())
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer flows[i].conn.Close()
			if seen := askOn(t, flows[i].conn, "small"); seen != c.node.String() {
				t.Fatalf("UDP to %s seen as %q", c.remote, seen)
			}
		}
		removeClientRule(t, s, spec.sources)
		for _, c := range flows {
			// 3 300 bytes: fragmented by the client (MTU 1500).
			if seen := askOn(t, c.conn, strings.Repeat("fragmented ", 300)); seen != c.node.String() {
				t.Errorf("a fragmented datagram to %s after the rule was removed: seen as %q", c.remote, seen)
			}
		}
	})
}

// askOn sends msg on a connected UDP socket, up to 3 times, and returns the
// answer ("" when none came).
func askOn(t *testing.T, c net.Conn, msg string) string {
	t.Helper()
	buf := make([]byte, 128)
	for range 3 {
		c.SetDeadline(time.Now().Add(time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatalf("send %d bytes: %v", len(msg), err)
		}
		if n, err := c.Read(buf); err == nil {
			return string(buf[:n])
		}
	}
	return ""
}
