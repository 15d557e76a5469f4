// Command podprog is the workload of the real-node test's pods
// (testkit/nodee2e), a static binary in an image of its own. It is also
// the node's sandbox (pause) image.
//
//	podprog pause               sleep until SIGTERM (the sandbox image)
//	podprog dial ADDR...        every 200 ms, a TCP connection to each ADDR
//	                            that sends the pod's name and a newline
//	podprog stream ADDR         one TCP connection for the pod's whole life:
//	                            the name, a newline, then an 8-byte counter
//	                            every 10 ms, each echoed back and checked
//	podprog echo PORT           serve TCP on PORT: answer every connection
//	                            with the address it came from and the pod's
//	                            name ("10.244.1.5 server-0\n"), then close
//	podprog ask ADDR...         every 200 ms, a TCP connection to each ADDR
//	                            (a name is resolved through the pod's DNS);
//	                            print "ADDR ANSWER" for each answer, to stdout
//	podprog query ADDR          every 20 ms, a UDP query to ADDR from a new
//	                            socket (its own flow), answered by a
//	                            resolver that echoes it with the source it
//	                            saw (topology.ServeResolver); every second
//	                            a line "asked=N answered=M failed=F
//	                            from=ADDR:COUNT,..." to stdout, and each
//	                            failure to stderr
//
// The pod's name is its hostname (the kubelet sets it). Any error ends the
// program with status 1, so that a lost or reset stream shows as a
// restarted container and a second connection, never as a silent retry.
package main

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fail(fmt.Errorf("usage: podprog pause | dial ADDR... | stream ADDR"))
	}
	name, err := os.Hostname()
	if err != nil {
		fail(err)
	}
	// PID 1 of a container gets no signal it has no handler for: without
	// this the kubelet would wait out the grace period on every delete.
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		os.Exit(0)
	}()
	switch args := os.Args[2:]; os.Args[1] {
	case "pause":
		for {
			time.Sleep(time.Hour)
		}
	case "dial":
		for {
			for _, a := range args {
				// A failed connection is reported and retried: the test
				// counts what arrives, not what was tried.
				if err := dialOnce(name, a); err != nil {
					fmt.Fprintln(os.Stderr, err)
				}
			}
			time.Sleep(200 * time.Millisecond)
		}
	case "stream":
		if len(args) != 1 {
			fail(fmt.Errorf("stream takes one address"))
		}
		fail(stream(name, args[0]))
	case "echo":
		if len(args) != 1 {
			fail(fmt.Errorf("echo takes one port"))
		}
		fail(echo(name, args[0]))
	case "ask":
		for {
			for _, a := range args {
				if line, err := ask(a); err != nil {
					fmt.Fprintln(os.Stderr, err)
				} else {
					fmt.Printf("%s %s\n", a, line)
				}
			}
			time.Sleep(200 * time.Millisecond)
		}
	case "query":
		if len(args) != 1 {
			fail(fmt.Errorf("query takes one address"))
		}
		fail(queryBurst(name, args[0]))
	default:
		fail(fmt.Errorf("unknown mode %q", os.Args[1]))
	}
}

func dialOnce(name, addr string) error {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := fmt.Fprintf(c, "%s\n", name); err != nil {
		return err
	}
	// Wait for the server's close, so the connection was accepted.
	_, err = io.Copy(io.Discard, c)
	return err
}

// stream never returns nil: it sends until something fails.
func stream(name, addr string) error {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := fmt.Fprintf(c, "%s\n", name); err != nil {
		return err
	}
	echo := make(chan error, 1)
	go func() {
		r := bufio.NewReader(c)
		var buf [8]byte
		for want := uint64(0); ; want++ {
			if _, err := io.ReadFull(r, buf[:]); err != nil {
				echo <- fmt.Errorf("echo after %d: %w", want, err)
				return
			}
			if got := binary.BigEndian.Uint64(buf[:]); got != want {
				echo <- fmt.Errorf("echo %d, want %d", got, want)
				return
			}
		}
	}()
	var buf [8]byte
	for n := uint64(0); ; n++ {
		select {
		case err := <-echo:
			return err
		default:
		}
		binary.BigEndian.PutUint64(buf[:], n)
		if _, err := c.Write(buf[:]); err != nil {
			return fmt.Errorf("send %d: %w", n, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// echo never returns nil: it serves until the listener fails.
func echo(name, port string) error {
	ln, err := net.Listen("tcp", ":"+port)
	if err != nil {
		return err
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		from, _, _ := net.SplitHostPort(c.RemoteAddr().String())
		fmt.Fprintf(c, "%s %s\n", from, name)
		c.Close()
	}
}

// ask connects to addr and returns the first line of its answer.
func ask(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("%s: %w", addr, err)
	}
	return line[:len(line)-1], nil
}

// queryBurst never returns nil: it asks until asking itself fails.
func queryBurst(name, addr string) error {
	var (
		mu                     sync.Mutex
		asked, answered, wrong int
		from                   = map[string]int{}
	)
	report := time.NewTicker(time.Second)
	defer report.Stop()
	next := time.NewTicker(20 * time.Millisecond)
	defer next.Stop()
	for seq := 0; ; seq++ {
		select {
		case <-report.C:
			mu.Lock()
			srcs := make([]string, 0, len(from))
			for a, n := range from {
				srcs = append(srcs, fmt.Sprintf("%s:%d", a, n))
			}
			sort.Strings(srcs)
			fmt.Printf("asked=%d answered=%d failed=%d from=%s\n", asked, answered, wrong, strings.Join(srcs, ","))
			mu.Unlock()
		case <-next.C:
		}
		c, err := net.Dial("udp", addr)
		if err != nil {
			return err
		}
		mu.Lock()
		asked++
		mu.Unlock()
		go func(seq int) {
			defer c.Close()
			q := fmt.Sprintf("%s %d", name, seq)
			c.SetDeadline(time.Now().Add(2 * time.Second))
			buf := make([]byte, 512)
			_, err := c.Write([]byte(q))
			var n int
			if err == nil {
				n, err = c.Read(buf)
			}
			var src string
			if err == nil {
				var ok bool
				if src, ok = strings.CutPrefix(string(buf[:n]), q+" "); !ok {
					err = fmt.Errorf("answer %q", buf[:n])
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				wrong++
				fmt.Fprintf(os.Stderr, "query %d: %v\n", seq, err)
				return
			}
			answered++
			from[src]++
		}(seq)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "podprog:", err)
	os.Exit(1)
}
