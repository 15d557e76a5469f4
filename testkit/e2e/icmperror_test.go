package e2e

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

const (
	bigUDPPort  = 7010 // answers every datagram with bigAnswer bytes
	bulkPort    = 7011 // writes bulkBytes to every connection
	refusedPort = 7012 // the port-unreachable scenario's server
	bigAnswer   = 1450
	bulkBytes   = 4 << 20
	podMTU      = 1400
)

// TestPMTUTowardPod: the node's end of the pod's veth has MTU 1400, the
// uplink 1500. The remote's 1450-byte answers (DF, Linux's default) make
// the node send "fragmentation needed" / "packet too big" to the remote;
// it only helps if the quote is in the remote's view of the flow (the
// node's address and NAT port). Then ≥ 8 of 10 answers arrive (the remote
// fragments them), IPv4 and IPv6, and a 4 MiB TCP transfer from the
// remote to the pod (which advertises a 1460-byte MSS) completes.
func TestPMTUTowardPod(t *testing.T) {
	spec := setupSpec{opts: topology.Options{PodMTU: podMTU}, config: masqueradeAll, sources: podSources}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		startBigServers(t, s.topo.Ext)
		for _, remote := range []netip.Addr{topology.RemoteIP4, topology.RemoteIP6} {
			if got := bigAnswers(t, s.topo.Pod, remote, 10); got < 8 {
				t.Errorf("%d of 10 answers of %d bytes from %s reached the pod, want ≥ 8", got, bigAnswer, remote)
			}
			if n, err := bulkFrom(s.topo.Pod, remote); err != nil || n != bulkBytes {
				t.Errorf("TCP transfer from %s to the pod: %d of %d bytes (%v)", remote, n, bulkBytes, err)
			}
		}
		if a := s.agent; a != nil && a.counter(bpf.CounterICMPErrorEgress) == 0 {
			t.Error("no ICMP error counted as translated on egress")
		}
	})
}

// startBigServers runs the big-answer UDP server (bound to each remote
// address, default socket options: DF until the path MTU is known) and
// the bulk TCP server in n.
func startBigServers(t *testing.T, n *topology.Netns) {
	t.Helper()
	var closers []io.Closer
	err := n.Do(func() error {
		for _, a := range []netip.Addr{topology.RemoteIP4, topology.RemoteIP6} {
			c, err := net.ListenPacket("udp", netip.AddrPortFrom(a, bigUDPPort).String())
			if err != nil {
				return err
			}
			closers = append(closers, c)
			go func() {
				buf := make([]byte, 2048)
				answer := make([]byte, bigAnswer)
				for {
					_, from, err := c.ReadFrom(buf)
					if err != nil {
						return
					}
					c.WriteTo(answer, from)
				}
			}()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("big servers in %s: %v", n.Name, err)
	}
	chunk := make([]byte, 64<<10) // only read: shared by the connections
	l, err := topology.ServeTCP(n, bulkPort, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(30 * time.Second))
		for sent := 0; sent < bulkBytes; sent += len(chunk) {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
	})
	if err != nil {
		t.Fatalf("bulk server in %s: %v", n.Name, err)
	}
	closers = append(closers, l)
	t.Cleanup(func() {
		for _, c := range closers {
			c.Close()
		}
	})
}

// bigAnswers sends rounds requests from one pod socket, one at a time, and
// counts the full-size answers.
func bigAnswers(t *testing.T, pod *topology.Netns, remote netip.Addr, rounds int) int {
	t.Helper()
	var c net.Conn
	if err := pod.Do(func() (err error) {
		c, err = net.Dial("udp", netip.AddrPortFrom(remote, bigUDPPort).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got := 0
	buf := make([]byte, 4096)
	for i := range rounds {
		if _, err := fmt.Fprintf(c, "request %d", i); err != nil {
			t.Fatal(err)
		}
		// Generous: a loaded machine (make test runs packages in
		// parallel) can take hundreds of milliseconds per round.
		c.SetReadDeadline(time.Now().Add(2 * time.Second))
		if n, err := c.Read(buf); err == nil && n == bigAnswer {
			got++
		}
	}
	return got
}

// bulkFrom reads everything the bulk server sends to a pod connection.
func bulkFrom(pod *topology.Netns, remote netip.Addr) (int64, error) {
	var c net.Conn
	if err := pod.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", netip.AddrPortFrom(remote, bulkPort).String(), 3*time.Second)
		return err
	}); err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return io.Copy(io.Discard, c)
}

// TestPodPortUnreachable: a pod answers a masqueraded flow with "port
// unreachable" (its socket is gone when the remote's answer arrives). The
// remote's kernel must match the error to its socket: it comes from the
// node's address and quotes the remote's datagram to the node's address
// and NAT port. The remote's socket has IP_RECVERR, so its error queue
// shows both (offender and original destination), IPv4 and IPv6.
func TestPodPortUnreachable(t *testing.T) {
	spec := setupSpec{config: masqueradeAll, sources: podSources}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		for _, c := range []struct{ remote, node netip.Addr }{
			{topology.RemoteIP4, topology.NodeIP4}, {topology.RemoteIP6, topology.NodeIP6},
		} {
			if err := portUnreachable(s.topo, c.remote, c.node); err != nil {
				t.Errorf("%s: %v", c.remote, err)
				if s.agent != nil {
					t.Logf("counters:\n%s", s.agent.counters())
				}
			}
		}
		if a := s.agent; a != nil && a.counter(bpf.CounterICMPErrorEgress) < 2 {
			t.Errorf("icmp-error-translated = %d, want ≥ 2", a.counter(bpf.CounterICMPErrorEgress))
		}
	})
}

func portUnreachable(topo *topology.Masquerade, remote, node netip.Addr) error {
	family, level, opt := unix.AF_INET, unix.SOL_IP, unix.IP_RECVERR
	if remote.Is6() {
		family, level, opt = unix.AF_INET6, unix.SOL_IPV6, unix.IPV6_RECVERR
	}
	var fd int
	err := topo.Ext.Do(func() (err error) {
		if fd, err = unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		if err := unix.SetsockoptInt(fd, level, opt, 1); err != nil {
			return err
		}
		return unix.Bind(fd, sockaddr(netip.AddrPortFrom(remote, refusedPort)))
	})
	if err != nil {
		return fmt.Errorf("remote socket: %w", err)
	}
	defer unix.Close(fd)
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 2})

	// The pod sends one datagram and closes its socket.
	var c net.Conn
	if err := topo.Pod.Do(func() (err error) {
		c, err = net.Dial("udp", netip.AddrPortFrom(remote, refusedPort).String())
		return err
	}); err != nil {
		return err
	}
	c.Write([]byte("hello"))
	time.Sleep(100 * time.Millisecond) // let neighbour discovery send it
	c.Close()

	buf := make([]byte, 256)
	// A blocking recvfrom with SO_RCVTIMEO is not restarted after a signal
	// (the Go runtime's preemption signals reach this thread too).
	_, from, err := unix.Recvfrom(fd, buf, 0)
	for errors.Is(err, unix.EINTR) {
		_, from, err = unix.Recvfrom(fd, buf, 0)
	}
	if err != nil {
		return fmt.Errorf("the pod's datagram did not arrive: %w", err)
	}
	natView := addrPort(from)
	if natView.Addr() != node {
		return fmt.Errorf("the pod's datagram came from %s, want %s", natView, node)
	}
	if err := unix.Sendto(fd, []byte("answer"), 0, from); err != nil {
		return err
	}
	oob := make([]byte, 512)
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		_, oobn, _, orig, err := unix.Recvmsg(fd, buf, oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
		if errors.Is(err, unix.EAGAIN) {
			continue
		}
		if err != nil {
			return fmt.Errorf("read the error queue: %w", err)
		}
		if got := addrPort(orig); got != natView {
			return fmt.Errorf("the error quotes a datagram to %s, want %s", got, natView)
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil || len(msgs) != 1 || len(msgs[0].Data) < 16+8 {
			return fmt.Errorf("no extended error in %d control bytes (%v)", oobn, err)
		}
		ee := msgs[0].Data
		errno, origin, typ, code := binary.NativeEndian.Uint32(ee[0:]), ee[4], ee[5], ee[6]
		offender := offenderAddr(ee[16:])
		if errno != uint32(unix.ECONNREFUSED) || origin < 2 || offender != node {
			return fmt.Errorf("error queue: errno %d origin %d type %d code %d from %s, want ECONNREFUSED by ICMP from %s", errno, origin, typ, code, offender, node)
		}
		return nil
	}
	return fmt.Errorf("no port unreachable reached the remote's socket")
}

func sockaddr(ap netip.AddrPort) unix.Sockaddr {
	if ap.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

func addrPort(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port))
	}
	return netip.AddrPort{}
}

// offenderAddr reads the sockaddr_in/in6 that follows struct
// sock_extended_err (SO_EE_OFFENDER): the sender of the ICMP error.
func offenderAddr(b []byte) netip.Addr {
	switch binary.NativeEndian.Uint16(b) {
	case unix.AF_INET:
		return netip.AddrFrom4([4]byte(b[4:8]))
	case unix.AF_INET6:
		if len(b) >= 24 {
			return netip.AddrFrom16([16]byte(b[8:24]))
		}
	}
	return netip.Addr{}
}
