package e2e

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

const (
	tcpPort  = 7000
	udpPort  = 7001
	sinkPort = 7002
)

// servers answer every TCP connection and UDP datagram with the source
// address they saw, and record the sources of ICMP echo requests.
type servers struct {
	mu        sync.Mutex
	echoSrcs  map[uint16][]netip.Addr // ICMP echo id → sources seen
	listeners []io.Closer
}

// startServers runs the servers in a namespace until the test ends. UDP
// sockets are bound to each address so a reply leaves from the address the
// request was sent to, as real servers do.
func startServers(t *testing.T, n *topology.Netns, addrs ...netip.Addr) *servers {
	s := &servers{echoSrcs: map[uint16][]netip.Addr{}}
	err := n.Do(func() error {
		for _, a := range addrs {
			ul, err := net.ListenPacket("udp", netip.AddrPortFrom(a, udpPort).String())
			if err != nil {
				return err
			}
			s.listeners = append(s.listeners, ul)
			go s.serveUDP(ul)
		}
		i4, err := net.ListenPacket("ip4:icmp", "0.0.0.0")
		if err != nil {
			return err
		}
		i6, err := net.ListenPacket("ip6:ipv6-icmp", "::")
		if err != nil {
			return err
		}
		sl, err := net.Listen("tcp", fmt.Sprintf("[::]:%d", sinkPort))
		if err != nil {
			return err
		}
		s.listeners = append(s.listeners, sl, i4, i6)
		go s.serveSink(sl)
		go s.watchICMP(i4, 8)
		go s.watchICMP(i6, 128)
		return nil
	})
	if err != nil {
		t.Fatalf("servers in %s: %v", n.Name, err)
	}
	tl, err := topology.ServeSource(n, tcpPort)
	if err != nil {
		t.Fatalf("TCP server in %s: %v", n.Name, err)
	}
	s.listeners = append(s.listeners, tl)
	t.Cleanup(func() {
		for _, l := range s.listeners {
			l.Close()
		}
	})
	return s
}

// serveSink reads until the client closes its side, then answers with the
// number of bytes read: large transfers in one direction only.
func (s *servers) serveSink(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			n, _ := io.Copy(io.Discard, c)
			fmt.Fprintf(c, "%d\n", n)
		}()
	}
}

func (s *servers) serveUDP(c net.PacketConn) {
	answerUDP(c, func(from netip.AddrPort) string { return from.Addr().Unmap().String() })
}

// answerUDP answers every datagram on c with answer(its sender) until c is
// closed.
func answerUDP(c net.PacketConn, answer func(from netip.AddrPort) string) {
	buf := make([]byte, 65536)
	for {
		_, from, err := c.ReadFrom(buf)
		if err != nil {
			return
		}
		c.WriteTo([]byte(answer(from.(*net.UDPAddr).AddrPort())), from)
	}
}

func (s *servers) watchICMP(c net.PacketConn, echoType byte) {
	buf := make([]byte, 65536)
	for {
		n, from, err := c.ReadFrom(buf)
		if err != nil {
			return
		}
		if n < 8 || buf[0] != echoType {
			continue
		}
		id := binary.BigEndian.Uint16(buf[4:6])
		src, _ := netip.ParseAddr(from.String())
		s.mu.Lock()
		s.echoSrcs[id] = append(s.echoSrcs[id], src.Unmap())
		s.mu.Unlock()
	}
}

// echoSources returns the sources seen for an echo id the NAT may have
// changed: all sources of all ids.
func (s *servers) echoSources() []netip.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []netip.Addr
	for _, srcs := range s.echoSrcs {
		out = append(out, srcs...)
	}
	return out
}

func (s *servers) resetEcho() {
	s.mu.Lock()
	s.echoSrcs = map[uint16][]netip.Addr{}
	s.mu.Unlock()
}

// dialTCP connects from the pod and returns the connection and the source
// address the server saw.
func dialTCP(pod *topology.Netns, dst netip.Addr) (net.Conn, string, error) {
	return topology.DialSource(pod, netip.AddrPortFrom(dst, tcpPort))
}

// tcpSource opens one TCP flow from the pod and returns what the server saw.
func tcpSource(pod *topology.Netns, dst netip.Addr) (string, error) {
	return topology.SeenSource(pod, netip.AddrPortFrom(dst, tcpPort))
}

// udpSource sends one datagram from a new pod socket (a new flow) and
// returns what the server saw.
func udpSource(pod *topology.Netns, dst netip.Addr) (string, error) {
	return udpAsk(pod, dst, 3, time.Second)
}

// udpAsk sends a datagram from a new pod socket, up to tries times, each
// waiting wait for the answer, and returns the answer (what the server saw).
func udpAsk(pod *topology.Netns, dst netip.Addr, tries int, wait time.Duration) (string, error) {
	seen, _, err := udpAskFrom(pod, dst, tries, wait)
	return seen, err
}

// udpAskFrom is udpAsk that also returns the socket's local end.
func udpAskFrom(pod *topology.Netns, dst netip.Addr, tries int, wait time.Duration) (string, netip.AddrPort, error) {
	c, err := dialNewUDPFlow(pod, netip.AddrPortFrom(dst, udpPort))
	if err != nil {
		return "", netip.AddrPort{}, err
	}
	defer c.Close()
	local, _ := netip.ParseAddrPort(c.LocalAddr().String())
	buf := make([]byte, 128)
	for try := 0; try < tries; try++ {
		c.SetDeadline(time.Now().Add(wait))
		if _, err := c.Write([]byte("who am i")); err != nil {
			return "", local, err
		}
		var n int
		if n, err = c.Read(buf); err == nil {
			return string(buf[:n]), local, nil
		}
	}
	return "", local, fmt.Errorf("no UDP answer from %s: %w", dst, err)
}

// udpFlowsUsed are the local and remote ends of the UDP sockets
// dialNewUDPFlow handed out, each with when.
var udpFlowsUsed = struct {
	sync.Mutex
	at map[[2]netip.AddrPort]time.Time
}{at: map[[2]netip.AddrPort]time.Time{}}

// udpFlowReuse is how long a UDP flow's tuple is not handed out again: longer
// than a replied UDP pair lives (--nat-timeout-udp-replied, 120 s).
const udpFlowReuse = 5 * time.Minute

// dialNewUDPFlow dials dst from a new socket of the namespace whose 5-tuple
// no socket of this test process used within udpFlowReuse. The kernel picks a
// UDP socket's port at random, so a new socket takes the port of one a few
// seconds old now and then, and its datagrams are that flow's, translated as
// its pair says (by Linux conntrack as by ipmasq), whatever the config says
// now. After 20 tries (a namespace with a narrow ip_local_port_range) it
// takes the port the kernel gives.
func dialNewUDPFlow(ns *topology.Netns, dst netip.AddrPort) (net.Conn, error) {
	udpFlowsUsed.Lock()
	defer udpFlowsUsed.Unlock()
	for try := 0; ; try++ {
		var c net.Conn
		if err := ns.Do(func() (err error) {
			c, err = net.Dial("udp", dst.String())
			return err
		}); err != nil {
			return nil, err
		}
		key := [2]netip.AddrPort{c.LocalAddr().(*net.UDPAddr).AddrPort(), dst}
		if last, ok := udpFlowsUsed.at[key]; !ok || time.Since(last) > udpFlowReuse || try == 19 {
			udpFlowsUsed.at[key] = time.Now()
			return c, nil
		}
		c.Close()
	}
}

// ping sends one ICMP echo request from the pod and waits for its reply.
func ping(pod *topology.Netns, dst netip.Addr, id, seq uint16) error {
	network, laddr, typ := "ip4:icmp", "0.0.0.0", byte(8)
	if dst.Is6() {
		network, laddr, typ = "ip6:ipv6-icmp", "::", 128
	}
	var c net.PacketConn
	if err := pod.Do(func() (err error) { c, err = net.ListenPacket(network, laddr); return err }); err != nil {
		return err
	}
	defer c.Close()
	msg := []byte{typ, 0, 0, 0, byte(id >> 8), byte(id), byte(seq >> 8), byte(seq), 'i', 'p', 'm', 'a', 's', 'q'}
	if dst.Is4() {
		binary.BigEndian.PutUint16(msg[2:], icmpChecksum(msg))
	} // the kernel fills in the ICMPv6 checksum
	if _, err := c.WriteTo(msg, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
		return err
	}
	buf := make([]byte, 1500)
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		c.SetReadDeadline(deadline)
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			return fmt.Errorf("no echo reply from %s: %w", dst, err)
		}
		if n >= 8 && (buf[0] == 0 || buf[0] == 129) &&
			binary.BigEndian.Uint16(buf[4:]) == id && binary.BigEndian.Uint16(buf[6:]) == seq {
			return nil
		}
	}
	return fmt.Errorf("no echo reply from %s", dst)
}

func icmpChecksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
