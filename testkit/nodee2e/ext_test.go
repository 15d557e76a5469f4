package nodee2e

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// external is the host outside the node that pods talk to: it records
// from which address each pod's connections arrive.
type external struct {
	mu sync.Mutex
	// seen: pod name -> listening address -> source addresses.
	seen map[string]map[string]map[netip.Addr]int
	// streams: pod name -> its stream connections.
	streams map[string][]*streamConn
}

// streamConn is one stream connection as the server sees it.
type streamConn struct {
	From netip.Addr
	mu   sync.Mutex
	n    uint64 // counters received in order
	err  error  // why it ended (nil while it runs)
}

// Progress is the number of counters received so far and the error that
// ended the stream, if any.
func (s *streamConn) Progress() (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n, s.err
}

func newExternal() *external {
	return &external{seen: map[string]map[string]map[netip.Addr]int{}, streams: map[string][]*streamConn{}}
}

// serveDial records the pod name line of every connection to port, by
// the address it was made to.
func (e *external) serveDial(t *testing.T, ns *topology.Netns, port uint16) {
	t.Helper()
	serve(t, ns, port, func(c net.Conn) {
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			return
		}
		to := c.LocalAddr().(*net.TCPAddr).AddrPort()
		addr := netip.AddrPortFrom(to.Addr().Unmap(), to.Port()).String()
		e.mu.Lock()
		defer e.mu.Unlock()
		pod := strings.TrimSpace(line)
		if e.seen[pod] == nil {
			e.seen[pod] = map[string]map[netip.Addr]int{}
		}
		if e.seen[pod][addr] == nil {
			e.seen[pod][addr] = map[netip.Addr]int{}
		}
		e.seen[pod][addr][remote(c)]++
	})
}

// remote is a connection's source address (IPv4 unmapped).
func remote(c net.Conn) netip.Addr {
	return c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap()
}

// sources are the addresses pod's connections to addr came from.
func (e *external) sources(pod, addr string) map[netip.Addr]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := map[netip.Addr]int{}
	for a, n := range e.seen[pod][addr] {
		out[a] = n
	}
	return out
}

// serveStream echoes every stream connection to port and checks its
// counters arrive in order.
func (e *external) serveStream(t *testing.T, ns *topology.Netns, port uint16) {
	t.Helper()
	serve(t, ns, port, e.stream)
}

func (e *external) stream(c net.Conn) {
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return
	}
	s := &streamConn{From: remote(c)}
	e.mu.Lock()
	pod := strings.TrimSpace(line)
	e.streams[pod] = append(e.streams[pod], s)
	e.mu.Unlock()
	var buf [8]byte
	for want := uint64(0); ; want++ {
		_, err := io.ReadFull(r, buf[:])
		if err == nil {
			if got := binary.BigEndian.Uint64(buf[:]); got != want {
				err = fmt.Errorf("counter %d where %d was due: bytes lost or reordered", got, want)
			}
		}
		if err == nil {
			_, err = c.Write(buf[:])
		}
		s.mu.Lock()
		if err != nil {
			s.err = err
			s.mu.Unlock()
			return
		}
		s.n++
		s.mu.Unlock()
	}
}

// streamsOf are pod's stream connections.
func (e *external) streamsOf(pod string) []*streamConn {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*streamConn(nil), e.streams[pod]...)
}

// serve runs handle for every connection to port on ns until the test
// ends.
func serve(t *testing.T, ns *topology.Netns, port uint16, handle func(net.Conn)) {
	t.Helper()
	ln, err := topology.ServeTCP(ns, port, handle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
}
