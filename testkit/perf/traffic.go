package perf

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// RoleEnv, when set in the environment of the test binary, makes it run one
// traffic process instead of the benchmarks: RoleServer or RoleClient.
const RoleEnv = "IPMASQ_PERF_ROLE"

// FlowPortsEnv is the number of flow ports the server listens on.
const FlowPortsEnv = "IPMASQ_PERF_FLOW_PORTS"

// Roles of the traffic processes.
const (
	RoleServer = "server"
	RoleClient = "client"
)

// Ports of the servers: one sink for bulk transfers, and FlowPortBase... for
// short connections. Spreading short connections over many destination
// ports keeps every NAT (ipmasq's per-destination port range, conntrack's
// tuples, the client's own ephemeral ports) far from exhaustion, so the
// benchmark measures the datapath and not a port allocator under pressure.
const (
	SinkPort     = 9000
	FlowPortBase = 9100
)

// RunRole runs the process named by RoleEnv until its stdin closes (the
// benchmark went away) and returns the exit code.
func RunRole(role string) int {
	var err error
	switch role {
	case RoleServer:
		ports, perr := strconv.Atoi(os.Getenv(FlowPortsEnv))
		if perr != nil || ports < 1 {
			err = fmt.Errorf("%s=%q: want a positive number", FlowPortsEnv, os.Getenv(FlowPortsEnv))
			break
		}
		err = serve(ports, os.Stdin, os.Stdout)
	case RoleClient:
		err = runClient(os.Stdin, os.Stdout)
	default:
		err = fmt.Errorf("%s=%q: want %s or %s", RoleEnv, role, RoleServer, RoleClient)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "perf %s: %v\n", role, err)
		return 1
	}
	return 0
}

// serve listens on the sink and flow ports, says "ready", and serves until
// stdin closes.
func serve(flowPorts int, stdin io.Reader, stdout io.Writer) error {
	sink, err := net.Listen("tcp", fmt.Sprintf("[::]:%d", SinkPort))
	if err != nil {
		return err
	}
	go acceptLoop(sink, serveSink)
	for i := range flowPorts {
		l, err := net.Listen("tcp", fmt.Sprintf("[::]:%d", FlowPortBase+i))
		if err != nil {
			return err
		}
		go acceptLoop(l, serveFlow)
	}
	fmt.Fprintln(stdout, "ready")
	io.Copy(io.Discard, stdin)
	return nil
}

func acceptLoop(l net.Listener, handle func(net.Conn)) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go handle(c)
	}
}

// serveSink reads and drops everything: bulk transfers in one direction.
func serveSink(c net.Conn) {
	defer c.Close()
	buf := make([]byte, 256<<10)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
	}
}

// Request bytes of a short connection: who closes first, and so holds
// TIME_WAIT.
const (
	serverCloses = 's'
	clientCloses = 'c'
)

// serveFlow answers a 1-byte request with 1 byte, then closes at once
// (serverCloses) or waits for the client to close first (clientCloses).
func serveFlow(c net.Conn) {
	defer c.Close()
	var b [1]byte
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return
	}
	if _, err := c.Write(b[:]); err != nil {
		return
	}
	if b[0] == clientCloses {
		io.Copy(io.Discard, c)
	}
}

// Request is one measurement the client makes.
type Request struct {
	// Op is "throughput", "flows" or "check".
	Op string
	// Addr is the server address (without port).
	Addr string
	// Ports is the number of flow ports to spread connections over.
	Ports int
	// Conns is the number of concurrent connection loops for "flows".
	Conns int
	// ClientCloses makes the client close short connections first (its
	// side holds TIME_WAIT); otherwise the server closes first.
	ClientCloses bool
	// Warmup is not counted; Duration is.
	Warmup, Duration time.Duration
}

// Result is the client's answer.
type Result struct {
	// Bytes written during Duration ("throughput").
	Bytes int64
	// OK and Failed connections completed during Duration ("flows").
	OK, Failed int64
	// Seconds actually measured.
	Seconds float64
	Err     string `json:",omitempty"`
}

func runClient(stdin io.Reader, stdout io.Writer) error {
	sc := bufio.NewScanner(stdin)
	enc := json.NewEncoder(stdout)
	for sc.Scan() {
		var req Request
		var res Result
		var err error
		if err = json.Unmarshal(sc.Bytes(), &req); err == nil {
			switch req.Op {
			case "throughput":
				res, err = throughput(req)
			case "flows":
				res, err = flows(req)
			case "check":
				err = oneFlow(&net.Dialer{Timeout: 2 * time.Second}, net.JoinHostPort(req.Addr, strconv.Itoa(FlowPortBase)), req.ClientCloses)
			default:
				err = fmt.Errorf("unknown op %q", req.Op)
			}
		}
		if err != nil {
			res.Err = err.Error()
		}
		if err := enc.Encode(res); err != nil {
			return err
		}
	}
	return sc.Err()
}

// throughput writes to the sink as fast as it can and counts the bytes the
// kernel accepted after the warmup. Over a second or more, the socket
// buffers' worth of bytes not yet delivered is well under 1%.
func throughput(req Request) (Result, error) {
	c, err := net.DialTimeout("tcp", net.JoinHostPort(req.Addr, strconv.Itoa(SinkPort)), 3*time.Second)
	if err != nil {
		return Result{}, err
	}
	defer c.Close()
	buf := make([]byte, 128<<10)
	start := time.Now()
	from, end := start.Add(req.Warmup), start.Add(req.Warmup+req.Duration)
	c.SetWriteDeadline(from)
	for {
		if _, err := c.Write(buf); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				break
			}
			return Result{}, fmt.Errorf("warmup: %w", err)
		}
	}
	var n int64
	t0 := time.Now()
	c.SetWriteDeadline(end)
	for {
		w, err := c.Write(buf)
		n += int64(w)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				break
			}
			return Result{}, err
		}
	}
	return Result{Bytes: n, Seconds: time.Since(t0).Seconds()}, nil
}

// flows runs req.Conns loops of short connections (connect, 1-byte request,
// 1-byte reply, close) and counts those that ended inside the measured
// window. A connection begun inside the window that fails (after 2 s: a
// dropped SYN waits for its retransmissions) is counted as failed.
func flows(req Request) (Result, error) {
	if req.Ports < 1 || req.Conns < 1 {
		return Result{}, fmt.Errorf("flows: want ports and conns > 0")
	}
	var seq atomic.Uint64
	var ok, failed atomic.Int64
	start := time.Now()
	from, end := start.Add(req.Warmup), start.Add(req.Warmup+req.Duration)
	d := &net.Dialer{Timeout: 2 * time.Second}
	var wg sync.WaitGroup
	for range req.Conns {
		wg.Go(func() {
			for {
				began := time.Now()
				if !began.Before(end) {
					return
				}
				port := FlowPortBase + int(seq.Add(1)%uint64(req.Ports))
				err := oneFlow(d, net.JoinHostPort(req.Addr, strconv.Itoa(port)), req.ClientCloses)
				now := time.Now()
				switch {
				case err != nil && !began.Before(from):
					// Counted even when its timeout ends after the window.
					failed.Add(1)
				case err == nil && !now.Before(from) && !now.After(end):
					ok.Add(1)
				}
			}
		})
	}
	wg.Wait()
	return Result{OK: ok.Load(), Failed: failed.Load(), Seconds: req.Duration.Seconds()}, nil
}

// oneFlow makes one short connection: connect, 1-byte request, 1-byte
// reply, close (after the server's close unless clientCloses).
func oneFlow(d *net.Dialer, addr string, clientFirst bool) error {
	c, err := d.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	b := [1]byte{serverCloses}
	if clientFirst {
		b[0] = clientCloses
	}
	if _, err := c.Write(b[:]); err != nil {
		return err
	}
	if _, err = io.ReadFull(c, b[:]); err != nil || clientFirst {
		return err
	}
	if n, err := c.Read(b[:]); n != 0 || err != io.EOF {
		return fmt.Errorf("want the server's close, got %d bytes, %v", n, err)
	}
	return nil
}
