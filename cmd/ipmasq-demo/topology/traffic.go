package topology

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"
)

// ServeSource runs a TCP server in n on port: to every connection it writes
// the source address it sees and a newline, then echoes everything back.
// It stops when the returned listener is closed.
func ServeSource(n *Netns, port uint16) (net.Listener, error) {
	return ServeTCP(n, port, func(c net.Conn) {
		ap := c.RemoteAddr().(*net.TCPAddr).AddrPort()
		fmt.Fprintf(c, "%s\n", ap.Addr().Unmap())
		io.Copy(c, c)
	})
}

// ServeTCP listens on port in n (both families) and runs handle for every
// connection in a goroutine of its own, closing the connection after it.
// It stops when the returned listener is closed.
func ServeTCP(n *Netns, port uint16, handle func(net.Conn)) (net.Listener, error) {
	var l net.Listener
	err := n.Do(func() (err error) {
		l, err = net.Listen("tcp", fmt.Sprintf("[::]:%d", port))
		return err
	})
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return l, nil
}

// DialSource connects from n to a ServeSource server and returns the
// connection and the source address the server saw.
func DialSource(n *Netns, dst netip.AddrPort) (net.Conn, string, error) {
	return DialSourceFrom(n, 0, dst)
}

// DialSourceFrom is DialSource from source port sport (0: the kernel's
// choice).
func DialSourceFrom(n *Netns, sport uint16, dst netip.AddrPort) (net.Conn, string, error) {
	var c net.Conn
	err := n.Do(func() (err error) {
		d := net.Dialer{Timeout: 3 * time.Second}
		if sport != 0 {
			d.LocalAddr = &net.TCPAddr{Port: int(sport)}
		}
		c, err = d.Dial("tcp", dst.String())
		return err
	})
	if err != nil {
		return nil, "", err
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		c.Close()
		return nil, "", fmt.Errorf("read greeting from %s: %w", dst, err)
	}
	c.SetDeadline(time.Time{})
	return c, strings.TrimSpace(line), nil
}

// SeenSource opens one TCP flow from n to a ServeSource server and returns
// the source address the server saw.
func SeenSource(n *Netns, dst netip.AddrPort) (string, error) {
	c, seen, err := DialSource(n, dst)
	if err != nil {
		return "", err
	}
	c.Close()
	return seen, nil
}
