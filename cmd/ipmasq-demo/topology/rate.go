package topology

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Short connections at a steady rate: the load that exhausts a NAT's ports
// toward one destination (every connection to the same address and port).

// Who closes a short connection first, and so holds its TIME_WAIT.
const (
	ServerClosesFirst = 's'
	ClientClosesFirst = 'c'
)

// ServeShort runs a TCP server in n on port for short connections: it reads
// a 1-byte request, answers with the same byte, and then closes at once
// (ServerClosesFirst) or waits for the client to close (ClientClosesFirst).
// It stops when the returned listener is closed.
func ServeShort(n *Netns, port uint16) (net.Listener, error) {
	return ServeTCP(n, port, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(30 * time.Second))
		var b [1]byte
		if _, err := io.ReadFull(c, b[:]); err != nil {
			return
		}
		if _, err := c.Write(b[:]); err != nil {
			return
		}
		if b[0] == ClientClosesFirst {
			io.Copy(io.Discard, c)
		}
	})
}

// RateResult is what [ConnectAtRate] saw.
type RateResult struct {
	OK, Failed int
	// FirstFailure is when the first connection that failed was started,
	// since the start of the run, and FirstError its error.
	FirstFailure time.Duration
	FirstError   error
}

func (r RateResult) String() string {
	if r.Failed == 0 {
		return fmt.Sprintf("%d connections, 0 failed", r.OK)
	}
	return fmt.Sprintf("%d connections, %d failed, the first started at %.1fs: %v",
		r.OK+r.Failed, r.Failed, r.FirstFailure.Seconds(), r.FirstError)
}

// ConnectAtRate opens rate new TCP connections per second from n to dst (a
// ServeShort server) for d, each one request and answer, closed first by
// the side closer names. A connection fails when it is not set up, or not
// answered or closed, within timeout.
func ConnectAtRate(n *Netns, dst netip.AddrPort, rate int, d, timeout time.Duration, closer byte) RateResult {
	return ConnectAtRateFrom(n, nil, dst, rate, d, timeout, closer)
}

// ConnectAtRateFrom is ConnectAtRate with the connections' source addresses
// taken from sources in turn (addresses of n; none: the kernel's choice),
// as if that many pods shared the load.
func ConnectAtRateFrom(n *Netns, sources []netip.Addr, dst netip.AddrPort, rate int, d, timeout time.Duration, closer byte) RateResult {
	var (
		wg     sync.WaitGroup
		ok     atomic.Int64
		mu     sync.Mutex
		res    RateResult
		start  = time.Now()
		period = time.Second / time.Duration(rate)
		total  = int(d / period)
	)
	fail := func(at time.Duration, err error) {
		mu.Lock()
		defer mu.Unlock()
		if res.Failed == 0 || at < res.FirstFailure {
			res.FirstFailure, res.FirstError = at, err
		}
		res.Failed++
	}
	for i := range total {
		// Keep the schedule: a slow dial does not delay the next ones.
		if wait := time.Until(start.Add(time.Duration(i) * period)); wait > 0 {
			time.Sleep(wait)
		}
		wg.Add(1)
		var src netip.Addr
		if len(sources) > 0 {
			src = sources[i%len(sources)]
		}
		go func(at time.Duration) {
			defer wg.Done()
			if err := shortConn(n, src, dst, timeout, closer); err != nil {
				fail(at, err)
				return
			}
			ok.Add(1)
		}(time.Since(start))
	}
	wg.Wait()
	res.OK = int(ok.Load())
	return res
}

func shortConn(n *Netns, src netip.Addr, dst netip.AddrPort, timeout time.Duration, closer byte) error {
	var c net.Conn
	d := net.Dialer{Timeout: timeout}
	if src.IsValid() {
		d.LocalAddr = net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))
	}
	if err := n.Do(func() (err error) {
		c, err = d.Dial("tcp", dst.String())
		return err
	}); err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	b := [1]byte{closer}
	if _, err := c.Write(b[:]); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return fmt.Errorf("read answer: %w", err)
	}
	if closer == ServerClosesFirst {
		// The server's FIN: wait for it so the server really closed first.
		if _, err := c.Read(b[:]); err != io.EOF {
			return fmt.Errorf("wait for the server to close: %v", err)
		}
	}
	return nil
}
