package topology

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"
)

// DNS-like load: queries from fresh sockets (a new source port each) at a
// steady rate to one or more resolvers, the way a node's pods look names
// up. Every query is a new flow for the masquerader, and its answer makes
// it a UDP query/answer pair (conntrack's 30 s one).

// resolverRcvBuf is the resolver socket's receive buffer: about 5 s of
// queries at 1 000/s (a small datagram takes ~768 bytes of buffer), so a
// stall of the process that runs the resolver loses none, whichever
// masquerader is under test.
const resolverRcvBuf = 4 << 20

// ServeResolver runs a UDP "resolver" in n on addr: it answers every
// datagram with the datagram itself, a space and the source address it
// saw. It stops when the returned connection is closed.
func ServeResolver(n *Netns, addr netip.AddrPort) (net.PacketConn, error) {
	var c *net.UDPConn
	if err := n.Do(func() (err error) {
		c, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(addr))
		return err
	}); err != nil {
		return nil, fmt.Errorf("%s: resolver on %s: %w", n.Name, addr, err)
	}
	// SO_RCVBUFFORCE (root) goes past net.core.rmem_max without touching
	// it: a socket option, no sysctl of the host or the namespace.
	raw, err := c.SyscallConn()
	if err == nil {
		var serr error
		err = raw.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUFFORCE, resolverRcvBuf)
		})
		if err == nil {
			err = serr
		}
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("%s: resolver on %s: SO_RCVBUFFORCE: %w", n.Name, addr, err)
	}
	go func() {
		buf := make([]byte, 512)
		for {
			m, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			ans := fmt.Appendf(buf[:m:m], " %s", from.Addr().Unmap())
			c.WriteToUDPAddrPort(ans, from)
		}
	}()
	return c, nil
}

// QueryResult is what [QueryAtRate] saw.
type QueryResult struct {
	Sent int
	// Answered counts the answers by the source address the resolver saw
	// the query come from.
	Answered map[netip.Addr]int
	// FirstFailure is when the first query that failed (no answer, a
	// wrong one, an error) was sent, since the start of the run, and
	// FirstError why.
	FirstFailure time.Duration
	FirstError   error
}

// AnsweredTotal is the number of queries answered, from any address.
func (r QueryResult) AnsweredTotal() int {
	n := 0
	for _, c := range r.Answered {
		n += c
	}
	return n
}

func (r QueryResult) String() string {
	s := fmt.Sprintf("%d of %d queries answered", r.AnsweredTotal(), r.Sent)
	for a, c := range r.Answered {
		s += fmt.Sprintf(", %d seen from %s", c, a)
	}
	if r.FirstError != nil {
		s += fmt.Sprintf("; the first failed was sent at %.1fs: %v", r.FirstFailure.Seconds(), r.FirstError)
	}
	return s
}

// QueryAtRate sends rate queries per second from n for d, each from a new
// UDP socket (connected: the kernel picks a source port of its ephemeral
// range) to the resolvers in turn ([ServeResolver]), and waits up to
// timeout for each answer. A query is sent once: a lost one is unanswered,
// as a resolver client sees it before it retries. With maxInFlight > 0 at
// most that many queries wait for their answers at once (the schedule
// resumes when one is answered, catching up without delay); 0 keeps the
// schedule whatever the answers do (an open loop, like many pods).
func QueryAtRate(n *Netns, resolvers []netip.AddrPort, rate int, d, timeout time.Duration, maxInFlight int) QueryResult {
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		res    = QueryResult{Answered: map[netip.Addr]int{}}
		start  = time.Now()
		period = time.Second / time.Duration(rate)
		total  = int(d / period)
		slots  chan struct{}
	)
	if maxInFlight > 0 {
		slots = make(chan struct{}, maxInFlight)
	}
	release := func() {
		if slots != nil {
			<-slots
		}
	}
	fail := func(at time.Duration, err error) {
		mu.Lock()
		defer mu.Unlock()
		if res.FirstError == nil || at < res.FirstFailure {
			res.FirstFailure, res.FirstError = at, err
		}
	}
	// The loop runs on a thread inside n, so each socket is n's; the
	// goroutines that wait for the answers may run anywhere.
	err := n.Do(func() error {
		for i := range total {
			if slots != nil {
				slots <- struct{}{}
			}
			if wait := time.Until(start.Add(time.Duration(i) * period)); wait > 0 {
				time.Sleep(wait)
			}
			at := time.Since(start)
			dst := resolvers[i%len(resolvers)]
			res.Sent++
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(dst))
			if err != nil {
				fail(at, fmt.Errorf("query %d: socket: %w", i, err))
				release()
				continue
			}
			q := fmt.Appendf(nil, "query %d", i)
			if _, err := c.Write(q); err != nil {
				fail(at, fmt.Errorf("query %d to %s: %w", i, dst, err))
				c.Close()
				release()
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer release()
				defer c.Close()
				seen, err := readAnswer(c, q, timeout)
				if err != nil {
					fail(at, fmt.Errorf("query %d to %s: %w", i, dst, err))
					return
				}
				mu.Lock()
				res.Answered[seen]++
				mu.Unlock()
			}()
		}
		return nil
	})
	wg.Wait()
	if err != nil {
		fail(0, err)
	}
	return res
}

// readAnswer reads the answer to q on c and returns the source address
// the resolver saw.
func readAnswer(c *net.UDPConn, q []byte, timeout time.Duration) (netip.Addr, error) {
	c.SetReadDeadline(time.Now().Add(timeout))
	buf := make([]byte, 512)
	m, err := c.Read(buf)
	if err != nil {
		return netip.Addr{}, err
	}
	rest, ok := bytes.CutPrefix(buf[:m], append(q, ' '))
	if !ok {
		return netip.Addr{}, fmt.Errorf("answer %q is not to %q", buf[:m], q)
	}
	seen, err := netip.ParseAddr(string(rest))
	if err != nil {
		return netip.Addr{}, fmt.Errorf("answer %q: %w", buf[:m], err)
	}
	return seen, nil
}
