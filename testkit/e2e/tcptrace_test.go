package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// tcpTrace keeps the last segments to or from one TCP port seen on a
// device (a packet socket: both directions), for the report of a stream
// that broke: who sent the reset, from which port.
type tcpTrace struct {
	name  string
	port  uint16
	f     *os.File
	done  chan struct{}
	mu    sync.Mutex
	flows map[uint16]*ring // by the other end's port
	order []uint16
}

// ring keeps the last lines of one flow.
type ring struct {
	lines []string
	next  int
	full  bool
}

// traceTCP records the segments of port on dev in n until the test ends,
// and logs the last ones if the test failed.
func traceTCP(t *testing.T, n *topology.Netns, dev string, port uint16) *tcpTrace {
	t.Helper()
	f := openStampedSocket(t, n, dev)
	tr := &tcpTrace{name: n.Name + "/" + dev, port: port, f: f, done: make(chan struct{}), flows: map[uint16]*ring{}}
	go tr.read()
	t.Cleanup(func() {
		f.Close()
		<-tr.done
		if t.Failed() {
			t.Logf("last TCP segments of port %d on %s:\n%s", port, tr.name, tr.last())
		}
	})
	return tr
}

// openStampedSocket opens a packet socket on dev in n (both directions,
// from the IP header on) whose packets carry the kernel's time of arrival.
func openStampedSocket(t *testing.T, n *topology.Netns, dev string) *os.File {
	t.Helper()
	f, err := topology.OpenPacketSocket(n, dev, unix.ETH_P_ALL)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.SetsockoptInt(int(f.Fd()), unix.SOL_SOCKET, unix.SO_TIMESTAMPNS, 1); err != nil {
		f.Close()
		t.Fatal(err)
	}
	return f
}

// readStamped calls fn with each packet read from f (a packet socket with
// SO_TIMESTAMPNS) and the kernel's time of its arrival, until f is closed.
func readStamped(f *os.File, size int, fn func(stamp time.Time, pkt []byte)) {
	buf := make([]byte, size)
	oob := make([]byte, 256)
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	for {
		var n, oobn int
		var rerr error
		err := rc.Read(func(fd uintptr) bool {
			n, oobn, _, _, rerr = unix.Recvmsg(int(fd), buf, oob, 0)
			return rerr != unix.EAGAIN
		})
		if err != nil || rerr != nil {
			return
		}
		stamp := time.Now()
		if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, m := range msgs {
				if m.Header.Level == unix.SOL_SOCKET && m.Header.Type == unix.SO_TIMESTAMPNS && len(m.Data) >= 16 {
					ts := *(*unix.Timespec)(unsafe.Pointer(&m.Data[0]))
					stamp = time.Unix(ts.Unix())
				}
			}
		}
		fn(stamp, buf[:n])
	}
}

func (tr *tcpTrace) read() {
	defer close(tr.done)
	readStamped(tr.f, 65536, tr.record)
}

// record keeps buf if it is a segment of the port.
func (tr *tcpTrace) record(stamp time.Time, buf []byte) {
	n := len(buf)
	if n < 40 || buf[0]>>4 != 4 || buf[9] != unix.IPPROTO_TCP {
		return
	}
	ihl := int(buf[0]&0xf) * 4
	if n < ihl+20 {
		return
	}
	l4 := buf[ihl:]
	sport, dport := uint16(l4[0])<<8|uint16(l4[1]), uint16(l4[2])<<8|uint16(l4[3])
	if sport != tr.port && dport != tr.port {
		return
	}
	src, dst := netip.AddrFrom4([4]byte(buf[12:16])), netip.AddrFrom4([4]byte(buf[16:20]))
	seq := uint32(l4[4])<<24 | uint32(l4[5])<<16 | uint32(l4[6])<<8 | uint32(l4[7])
	ack := uint32(l4[8])<<24 | uint32(l4[9])<<16 | uint32(l4[10])<<8 | uint32(l4[11])
	flags := ""
	for i, c := range "FSRPAU" {
		if l4[13]&(1<<i) != 0 {
			flags += string(c)
		}
	}
	total := int(buf[2])<<8 | int(buf[3])
	payload := total - ihl - int(l4[12]>>4)*4
	line := fmt.Sprintf("%s %s:%d > %s:%d [%s] seq %d ack %d len %d", stamp.Format("15:04:05.000000"),
		src, sport, dst, dport, flags, seq, ack, payload)
	other := sport
	if other == tr.port {
		other = dport
	}
	tr.mu.Lock()
	r := tr.flows[other]
	if r == nil {
		r = &ring{lines: make([]string, 100)}
		tr.flows[other] = r
		tr.order = append(tr.order, other)
	}
	r.lines[r.next] = line
	r.next = (r.next + 1) % len(r.lines)
	r.full = r.full || r.next == 0
	tr.mu.Unlock()
}

// last returns the recorded segments of each flow, oldest first.
func (tr *tcpTrace) last() string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var lines []string
	for _, port := range tr.order {
		r := tr.flows[port]
		lines = append(lines, fmt.Sprintf("-- port %d:", port))
		if r.full {
			lines = append(lines, r.lines[r.next:]...)
		}
		lines = append(lines, r.lines[:r.next]...)
	}
	return strings.Join(lines, "\n")
}

// conntrackTable logs n's conntrack entries of port if the test failed.
func conntrackTable(t *testing.T, n *topology.Netns, port uint16) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		cmd := exec.Command("conntrack", "-L", "-p", "tcp", "--dport", fmt.Sprint(port))
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := n.Do(cmd.Run); err != nil {
			fmt.Fprintf(&out, "(%v)", err)
		}
		stats := exec.Command("conntrack", "-S")
		stats.Stdout, stats.Stderr = &out, &out
		n.Do(stats.Run)
		t.Logf("conntrack's TCP entries to port %d in %s:\n%s", port, n.Name, out.String())
	})
}

// conntrackEvents records n's conntrack TCP events (conntrack -E) and logs
// them if the test failed.
func conntrackEvents(t *testing.T, n *topology.Netns) {
	cmd := exec.Command("conntrack", "-E", "-p", "tcp", "-o", "timestamp,id")
	var out strings.Builder
	var mu sync.Mutex
	cmd.Stdout = &lockedWriter{w: &out, mu: &mu}
	cmd.Stderr = cmd.Stdout
	if err := n.Start(cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			mu.Lock()
			t.Logf("conntrack's TCP events in %s (the last 60):\n%s", n.Name, tail(out.String(), 60))
			mu.Unlock()
		}
	})
}

type lockedWriter struct {
	w  *strings.Builder
	mu *sync.Mutex
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}
