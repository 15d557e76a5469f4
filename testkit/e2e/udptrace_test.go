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

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// udpTrace keeps every datagram to or from one UDP port seen on a device
// (a packet socket: both directions), for the report of a query that went
// unanswered: where its datagram or its answer stopped, and with which
// ports.
type udpTrace struct {
	name  string
	port  uint16
	f     *os.File
	done  chan struct{}
	mu    sync.Mutex
	lines []stampedLine
}

type stampedLine struct {
	at   time.Time
	line string
}

// traceUDP records the datagrams of port on dev in n until the test ends.
func traceUDP(t *testing.T, n *topology.Netns, dev string, port uint16) *udpTrace {
	t.Helper()
	f := openStampedSocket(t, n, dev)
	tr := &udpTrace{name: n.Name + "/" + dev, port: port, f: f, done: make(chan struct{})}
	// Only the port's datagrams and ICMP reach the socket (not the
	// streams' segments), with room for bursts; the kernel's count of what
	// did not fit is in the report.
	if err := attachUDPPortFilter(f, port); err != nil {
		t.Fatal(err)
	}
	if err := unix.SetsockoptInt(int(f.Fd()), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20); err != nil {
		t.Fatal(err)
	}
	go tr.read()
	t.Cleanup(func() {
		f.Close()
		<-tr.done
	})
	return tr
}

func (tr *udpTrace) read() {
	defer close(tr.done)
	readStamped(tr.f, 2048, tr.record)
}

// record keeps buf if it is a datagram of the port or an ICMP error about
// one.
func (tr *udpTrace) record(stamp time.Time, buf []byte) {
	n := len(buf)
	if n < 28 || buf[0]>>4 != 4 || (buf[9] != unix.IPPROTO_UDP && buf[9] != unix.IPPROTO_ICMP) {
		return
	}
	ihl := int(buf[0]&0xf) * 4
	if n < ihl+8 {
		return
	}
	src, dst := netip.AddrFrom4([4]byte(buf[12:16])), netip.AddrFrom4([4]byte(buf[16:20]))
	l4 := buf[ihl:]
	var line string
	if buf[9] == unix.IPPROTO_ICMP {
		// An ICMP error about one of the port's datagrams (port
		// unreachable, say) quotes its header.
		q := l4[8 : n-ihl]
		if len(q) < 28 || q[9] != unix.IPPROTO_UDP {
			return
		}
		qihl := int(q[0]&0xf) * 4
		if len(q) < qihl+4 {
			return
		}
		qs, qd := uint16(q[qihl])<<8|uint16(q[qihl+1]), uint16(q[qihl+2])<<8|uint16(q[qihl+3])
		if qs != tr.port && qd != tr.port {
			return
		}
		line = fmt.Sprintf("%s ICMP %s > %s type %d code %d about %s:%d > %s:%d", stamp.Format("15:04:05.000000"),
			src, dst, l4[0], l4[1], netip.AddrFrom4([4]byte(q[12:16])), qs, netip.AddrFrom4([4]byte(q[16:20])), qd)
	} else {
		sport, dport := uint16(l4[0])<<8|uint16(l4[1]), uint16(l4[2])<<8|uint16(l4[3])
		if sport != tr.port && dport != tr.port {
			return
		}
		line = fmt.Sprintf("%s %s:%d > %s:%d", stamp.Format("15:04:05.000000"), src, sport, dst, dport)
	}
	tr.mu.Lock()
	tr.lines = append(tr.lines, stampedLine{stamp, line})
	tr.mu.Unlock()
}

// around returns the datagrams recorded from before to after, oldest first.
func (tr *udpTrace) around(from, to time.Time) string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var lines []string
	for _, l := range tr.lines {
		if !l.at.Before(from) && !l.at.After(to) {
			lines = append(lines, l.line)
		}
	}
	dropped := "unknown"
	if st, err := unix.GetsockoptTpacketStats(int(tr.f.Fd()), unix.SOL_PACKET, unix.PACKET_STATISTICS); err == nil {
		dropped = fmt.Sprint(st.Drops)
	}
	return fmt.Sprintf("datagrams of UDP port %d on %s from %s to %s (packets the trace's socket dropped since the last report: %s):\n%s",
		tr.port, tr.name, from.Format("15:04:05.000"), to.Format("15:04:05.000"), dropped, strings.Join(lines, "\n"))
}

// conntrackUDPEvents records n's conntrack UDP events (conntrack -E) for
// the report of an unanswered query.
type conntrackUDPEvents struct {
	mu  sync.Mutex
	out strings.Builder
}

func recordConntrackUDP(t *testing.T, n *topology.Netns) *conntrackUDPEvents {
	ev := &conntrackUDPEvents{}
	cmd := exec.Command("conntrack", "-E", "-p", "udp", "-o", "timestamp,id")
	cmd.Stdout = &lockedWriter{w: &ev.out, mu: &ev.mu}
	cmd.Stderr = cmd.Stdout
	if err := n.Start(cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return ev
}

// mentioning returns the events whose line holds s.
func (ev *conntrackUDPEvents) mentioning(s string) string {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	var lines []string
	for l := range strings.SplitSeq(ev.out.String(), "\n") {
		if strings.Contains(l, s) {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, "\n")
}

// attachUDPPortFilter lets through f (a packet socket whose packets start
// at the IP header) only IPv4 UDP datagrams to or from port, and ICMP.
func attachUDPPortFilter(f *os.File, port uint16) error {
	prog, err := bpf.Assemble([]bpf.Instruction{
		bpf.LoadAbsolute{Off: 0, Size: 1},
		bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: 0xf0},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: 0x40, SkipFalse: 9},
		bpf.LoadAbsolute{Off: 9, Size: 1},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: unix.IPPROTO_ICMP, SkipTrue: 6},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: unix.IPPROTO_UDP, SkipFalse: 6},
		bpf.LoadMemShift{Off: 0},
		bpf.LoadIndirect{Off: 0, Size: 2},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(port), SkipTrue: 2},
		bpf.LoadIndirect{Off: 2, Size: 2},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(port), SkipFalse: 1},
		bpf.RetConstant{Val: 0xffff},
		bpf.RetConstant{Val: 0},
	})
	if err != nil {
		return err
	}
	filter := make([]unix.SockFilter, len(prog))
	for i, ins := range prog {
		filter[i] = unix.SockFilter{Code: ins.Op, Jt: ins.Jt, Jf: ins.Jf, K: ins.K}
	}
	return unix.SetsockoptSockFprog(int(f.Fd()), unix.SOL_SOCKET, unix.SO_ATTACH_FILTER,
		&unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]})
}
