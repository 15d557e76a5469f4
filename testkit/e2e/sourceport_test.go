package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// whoAmIPort serves serveWhoAmI: it answers each TCP connection and UDP
// datagram with the address and port it came from.
const whoAmIPort = 7011

// serveWhoAmI answers, on whoAmIPort in n (RemoteIP4 and RemoteIP6), every TCP
// connection with one line "addr:port" of its peer and then echoes it, and
// every UDP datagram with "addr:port" of its sender.
func serveWhoAmI(t *testing.T, n *topology.Netns) {
	t.Helper()
	peer := func(ap netip.AddrPort) string { return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String() }
	l, err := topology.ServeTCP(n, whoAmIPort, func(c net.Conn) {
		fmt.Fprintf(c, "%s\n", peer(c.RemoteAddr().(*net.TCPAddr).AddrPort()))
		io.Copy(c, c)
	})
	if err != nil {
		t.Fatalf("who-am-i server: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	// One UDP socket per remote address: the answer must leave from the
	// address the datagram was sent to.
	for _, a := range []netip.Addr{topology.RemoteIP4, topology.RemoteIP6} {
		var pc net.PacketConn
		if err := n.Do(func() (err error) {
			pc, err = net.ListenPacket("udp", netip.AddrPortFrom(a, whoAmIPort).String())
			return err
		}); err != nil {
			t.Fatalf("who-am-i UDP server on %s: %v", a, err)
		}
		t.Cleanup(func() { pc.Close() })
		go answerUDP(pc, peer)
	}
}

// tcpFrom connects from src (address and port, in n) to dst and returns the
// connection and the source the server saw.
func tcpFrom(t *testing.T, n *topology.Netns, src, dst netip.AddrPort) (net.Conn, *bufio.Reader, netip.AddrPort) {
	t.Helper()
	var c net.Conn
	if err := n.Do(func() (err error) {
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(src), Timeout: 3 * time.Second}
		c, err = d.DialContext(context.Background(), "tcp", dst.String())
		return err
	}); err != nil {
		t.Fatalf("connect %s -> %s in %s: %v", src, dst, n.Name, err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(5 * time.Second))
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		t.Fatalf("%s -> %s: no answer: %v", src, dst, err)
	}
	return c, r, netip.MustParseAddrPort(strings.TrimSpace(line))
}

// stillEchoes requires c (from tcpFrom) to carry a line both ways.
func stillEchoes(t *testing.T, what string, c net.Conn, r *bufio.Reader) {
	t.Helper()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(c, "ping\n"); err != nil {
		t.Fatalf("%s: write: %v", what, err)
	}
	if line, err := r.ReadString('\n'); err != nil || line != "ping\n" {
		t.Fatalf("%s: echo %q, %v", what, line, err)
	}
}

// udpFrom sends one datagram from a socket bound to src (in n) to dst and
// returns the socket and the source the server saw.
func udpFrom(t *testing.T, n *topology.Netns, src, dst netip.AddrPort) (*net.UDPConn, netip.AddrPort) {
	t.Helper()
	c := bindUDP(t, n, src)
	return c, askUDPFrom(t, c, dst)
}

// askUDPFrom sends a datagram on c to dst and returns the source the
// who-am-i server saw.
func askUDPFrom(t *testing.T, c *net.UDPConn, dst netip.AddrPort) netip.AddrPort {
	t.Helper()
	seen, err := netip.ParseAddrPort(askUDP(t, c, dst))
	if err != nil {
		t.Fatalf("who-am-i answer: %v", err)
	}
	return seen
}

// TestSourcePortKept: a pod's flow leaves from its own source port when no
// other flow holds it toward that destination (as Linux MASQUERADE keeps
// it), so a destination sees the pods' own port spread, not one range. A
// second pod on the same port to the same destination gets another port;
// both flows carry on. TCP and UDP, IPv4 and IPv6 (one pod).
func TestSourcePortKept(t *testing.T) {
	pod2 := netip.MustParseAddr("10.244.1.77")
	underBoth(t, masqueradePods(), func(t *testing.T, s *scenario) {
		topo := s.topo
		if err := topo.Pod.Addr("eth0", pod2.String()+"/24"); err != nil {
			t.Fatal(err)
		}
		serveWhoAmI(t, topo.Ext)
		dst4 := netip.AddrPortFrom(topology.RemoteIP4, whoAmIPort)
		dst6 := netip.AddrPortFrom(topology.RemoteIP6, whoAmIPort)

		c1, r1, seen := tcpFrom(t, topo.Pod, netip.AddrPortFrom(topology.PodIP4, 45000), dst4)
		if want := netip.AddrPortFrom(topology.NodeIP4, 45000); seen != want {
			t.Fatalf("TCP from the pod's port 45000: server saw %s, want %s", seen, want)
		}
		c2, r2, seen2 := tcpFrom(t, topo.Pod, netip.AddrPortFrom(pod2, 45000), dst4)
		if seen2.Addr() != topology.NodeIP4 || seen2.Port() == 45000 {
			t.Fatalf("TCP from a second pod's port 45000: server saw %s, want %s and another port", seen2, topology.NodeIP4)
		}
		stillEchoes(t, "first pod's connection", c1, r1)
		stillEchoes(t, "second pod's connection", c2, r2)

		_, seen = udpFrom(t, topo.Pod, netip.AddrPortFrom(topology.PodIP4, 45001), dst4)
		if want := netip.AddrPortFrom(topology.NodeIP4, 45001); seen != want {
			t.Fatalf("UDP from the pod's port 45001: server saw %s, want %s", seen, want)
		}
		_, seen2 = udpFrom(t, topo.Pod, netip.AddrPortFrom(pod2, 45001), dst4)
		if seen2.Addr() != topology.NodeIP4 || seen2.Port() == 45001 {
			t.Fatalf("UDP from a second pod's port 45001: server saw %s, want another port", seen2)
		}

		_, _, seen = tcpFrom(t, topo.Pod, netip.AddrPortFrom(topology.PodIP6, 45002), dst6)
		if want := netip.AddrPortFrom(topology.NodeIP6, 45002); seen != want {
			t.Fatalf("IPv6 TCP from the pod's port 45002: server saw %s, want %s", seen, want)
		}
	})
}

// TestNodeFlowOnPodsKeptPort: a pod keeps its port P toward a server; then
// the node itself connects to that server from the same port P (its kernel
// does not know the pod's flow). Linux MASQUERADE gives the node's flow
// another port (conntrack's clash remap); so must ipmasq. Both flows carry
// on, TCP and UDP, IPv4 and IPv6.
func TestNodeFlowOnPodsKeptPort(t *testing.T) {
	underBoth(t, masqueradePods(), func(t *testing.T, s *scenario) {
		topo := s.topo
		serveWhoAmI(t, topo.Ext)
		for i, c := range []struct{ pod, node, remote netip.Addr }{
			{topology.PodIP4, topology.NodeIP4, topology.RemoteIP4},
			{topology.PodIP6, topology.NodeIP6, topology.RemoteIP6},
		} {
			dst := netip.AddrPortFrom(c.remote, whoAmIPort)
			port := uint16(46000 + 10*i)
			pc, pr, seen := tcpFrom(t, topo.Pod, netip.AddrPortFrom(c.pod, port), dst)
			if want := netip.AddrPortFrom(c.node, port); seen != want {
				t.Fatalf("pod's TCP flow: server saw %s, want %s", seen, want)
			}
			nc, nr, seen := tcpFrom(t, topo.Node, netip.AddrPortFrom(c.node, port), dst)
			if seen.Addr() != c.node || seen.Port() == port {
				t.Fatalf("node's TCP flow on the pod's port: server saw %s, want %s and another port", seen, c.node)
			}
			stillEchoes(t, "pod's connection", pc, pr)
			stillEchoes(t, "node's connection", nc, nr)

			podUDP, seen := udpFrom(t, topo.Pod, netip.AddrPortFrom(c.pod, port+1), dst)
			if want := netip.AddrPortFrom(c.node, port+1); seen != want {
				t.Fatalf("pod's UDP flow: server saw %s, want %s", seen, want)
			}
			nodeUDP, seen := udpFrom(t, topo.Node, netip.AddrPortFrom(c.node, port+1), dst)
			if seen.Addr() != c.node || seen.Port() == port+1 {
				t.Fatalf("node's UDP flow on the pod's port: server saw %s, want another port", seen)
			}
			if again := askUDPFrom(t, podUDP, dst); again.Port() != port+1 {
				t.Fatalf("pod's UDP flow after the node's: server saw %s", again)
			}
			if again := askUDPFrom(t, nodeUDP, dst); again != seen {
				t.Fatalf("node's UDP flow's second datagram: server saw %s, first %s", again, seen)
			}
		}
	})
}
