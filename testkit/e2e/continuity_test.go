package e2e

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/reconcilers/tcattach"
)

// stream keeps a TCP connection busy: it writes numbered chunks and checks
// that the echo comes back intact, until stopped.
type stream struct {
	conn    net.Conn
	echoed  atomic.Int64
	errc    chan error
	stopped atomic.Bool
}

func startStream(t *testing.T, pod *topology.Netns, dst netip.Addr) *stream {
	c, seen, err := dialTCP(pod, dst)
	if err != nil {
		t.Fatal(err)
	}
	if seen != topology.NodeIP4.String() && seen != topology.NodeIP6.String() {
		t.Fatalf("stream not masqueraded: server saw %s", seen)
	}
	return newStream(c)
}

// newStream keeps the TCP connection c to a ServeSource server busy.
func newStream(c net.Conn) *stream {
	s := &stream{conn: c, errc: make(chan error, 1)}
	go func() {
		chunk := make([]byte, 1024)
		got := make([]byte, len(chunk))
		for i := 0; !s.stopped.Load(); i++ {
			for j := range chunk {
				chunk[j] = byte(i + j)
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := c.Write(chunk); err != nil {
				s.errc <- fmt.Errorf("write after %d bytes: %w", s.echoed.Load(), err)
				return
			}
			if _, err := io.ReadFull(c, got); err != nil {
				s.errc <- fmt.Errorf("read after %d bytes: %w", s.echoed.Load(), err)
				return
			}
			if !bytes.Equal(chunk, got) {
				s.errc <- fmt.Errorf("corrupted echo after %d bytes", s.echoed.Load())
				return
			}
			s.echoed.Add(int64(len(chunk)))
		}
		s.errc <- nil
	}()
	return s
}

// progress waits until the stream has moved another n bytes.
func (s *stream) progress(t *testing.T, n int64, what string) {
	t.Helper()
	start := s.echoed.Load()
	deadline := time.Now().Add(10 * time.Second)
	for s.echoed.Load() < start+n {
		select {
		case err := <-s.errc:
			t.Fatalf("stream broke %s: %v", what, err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("stream stalled %s at %d bytes", what, s.echoed.Load())
		}
		time.Sleep(time.Millisecond)
	}
}

func (s *stream) stop(t *testing.T) {
	s.stopped.Store(true)
	if err := <-s.errc; err != nil {
		t.Fatalf("stream: %v", err)
	}
	s.conn.Close()
}

// TestRestartKeepsStreams: the agent stopped (SIGTERM) or killed (SIGKILL)
// and started again during long TCP streams does not break them: programs
// stay attached through pinned links and NAT state is in pinned maps.
func TestRestartKeepsStreams(t *testing.T) {
	topo, a, _ := setup(t, masqueradeAll)
	v4 := startStream(t, topo.Pod, topology.RemoteIP4)
	v6 := startStream(t, topo.Pod, topology.RemoteIP6)
	v4.progress(t, 64<<10, "before restarts")
	v6.progress(t, 64<<10, "before restarts")
	for i, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL, syscall.SIGTERM, syscall.SIGKILL} {
		a.stop(sig)
		v4.progress(t, 16<<10, fmt.Sprintf("while the agent is down (%d, %s)", i, sig))
		a.start()
		v4.progress(t, 16<<10, fmt.Sprintf("after restart %d", i))
		v6.progress(t, 16<<10, fmt.Sprintf("after restart %d", i))
		// New flows work after every restart.
		if seen, err := tcpSource(topo.Pod, topology.RemoteIP4); err != nil || seen != topology.NodeIP4.String() {
			t.Fatalf("new flow after restart %d: %q %v", i, seen, err)
		}
	}
	v4.stop(t)
	v6.stop(t)
}

// TestPathMTU: a router beyond the node (ext) sends "fragmentation needed"
// / "packet too big" to the node address for a masqueraded flow; the error
// is translated back to the pod, whose kernel lowers the path MTU, so a
// large TCP transfer to the far host completes instead of stalling.
func TestPathMTU(t *testing.T) {
	underBoth(t, masqueradePods(), func(t *testing.T, s *scenario) {
		topo := s.topo
		startServers(t, topo.Far, topology.FarIP4, topology.FarIP6)
		for _, far := range []netip.Addr{topology.FarIP4, topology.FarIP6} {
			var c net.Conn
			err := topo.Pod.Do(func() (err error) {
				c, err = net.DialTimeout("tcp", netip.AddrPortFrom(far, sinkPort).String(), 3*time.Second)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			payload := bytes.Repeat([]byte("ipmasq pmtu "), 20000) // 240 KB in full-size segments
			c.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := c.Write(payload); err != nil {
				t.Fatalf("%s: write: %v", far, err)
			}
			c.(*net.TCPConn).CloseWrite()
			answer, err := io.ReadAll(c)
			if err != nil || string(answer) != fmt.Sprintf("%d\n", len(payload)) {
				t.Fatalf("%s: large transfer stalled or was cut (path MTU discovery broken?): %q %v", far, answer, err)
			}
			if mtu := pathMTU(t, c, far); mtu != topology.FarMTU {
				t.Fatalf("%s: pod's path MTU is %d, want %d (the ICMP error did not reach the pod)", far, mtu, topology.FarMTU)
			}
			c.Close()
		}
	})
}

func pathMTU(t *testing.T, c net.Conn, dst netip.Addr) int {
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var mtu int
	var serr error
	raw.Control(func(fd uintptr) {
		if dst.Is4() {
			mtu, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_MTU)
		} else {
			mtu, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_MTU)
		}
	})
	if serr != nil {
		t.Fatal(serr)
	}
	return mtu
}

// TestNATPortRangeOverlap: a --nat-port-range inside the node's
// ip_local_port_range is not reserved (no sysctl is written: the datapath
// skips the node's sockets instead), and the masqueraded flows use ports
// from it (their own ports not kept).
func TestNATPortRangeOverlap(t *testing.T) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	startServers(t, topo.Ext, topology.RemoteIP4)
	a := newAgent(t, topo.Node, masqueradeAll)
	a.args = []string{"--nat-port-range=40000-40100", "--nat-keep-source-port=false"}
	a.start()
	var reserved []byte
	topo.Node.Do(func() (err error) {
		reserved, err = os.ReadFile("/proc/sys/net/ipv4/ip_local_reserved_ports")
		return err
	})
	if got := strings.TrimSpace(string(reserved)); got != "" {
		t.Fatalf("node's ip_local_reserved_ports = %q, want it empty as it was", got)
	}
	c, seen, err := dialTCP(topo.Pod, topology.RemoteIP4)
	if err != nil || seen != topology.NodeIP4.String() {
		t.Fatalf("flow: %q %v", seen, err)
	}
	defer c.Close()
	out := a.natEntries()
	if !strings.Contains(out, "10.0.0.5:400") && !strings.Contains(out, "10.0.0.5:40100") {
		t.Fatalf("NAT entries do not use the configured range:\n%s", out)
	}
}

// TestClsactAttach: with --tc-attach-mode=clsact (what kernels without tcx
// get) the programs run as clsact filters: traffic is masqueraded, streams
// survive a SIGKILL and restart, and a later agent in auto mode replaces the
// filters with tcx links without leaving them behind where the kernel has
// tcx (6.6), or keeps them working where it has not.
func TestClsactAttach(t *testing.T) {
	topo, a, ext := setup(t, masqueradeAll, "--tc-attach-mode=clsact")
	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 5)
	checkSource(t, topo, ext, topology.RemoteIP6, topology.NodeIP6, 5)
	// The uplink had no qdisc: the agent created it, and says so once
	// (docs/deploy.md, "Kernels without tcx").
	if n := a.logLines(tcattach.QdiscCreatedMsg); n != 1 {
		t.Fatalf("%d log lines say the agent created the uplink's clsact qdisc, want 1", n)
	}
	s := startStream(t, topo.Pod, topology.RemoteIP4)
	s.progress(t, 32<<10, "before the restart")
	a.stop(syscall.SIGKILL)
	s.progress(t, 16<<10, "while the agent is down")
	a.start()
	s.progress(t, 16<<10, "after the restart")
	// The restarted agent found the qdisc: no second graft.
	if n := a.logLines(tcattach.QdiscCreatedMsg); n != 1 {
		t.Fatalf("after the restart %d log lines say the agent created the uplink's clsact qdisc, want 1 (the first start's)", n)
	}

	a.stop(syscall.SIGTERM)
	a.args = nil // auto: tcx where the kernel has it
	a.start()
	if !tcxAvailable(t, topo.Node) {
		// Before 6.6 auto is clsact: the filters stay and keep working.
		s.progress(t, 16<<10, "after a restart in auto mode (clsact: the kernel has no tcx)")
		a.waitAttached("eth0")
		s.stop(t)
		checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 2)
		return
	}
	s.progress(t, 16<<10, "after switching to tcx")
	eth0, _ := topo.Node.NL.LinkByName("eth0")
	for _, parent := range []uint32{netlink.HANDLE_MIN_EGRESS, netlink.HANDLE_MIN_INGRESS} {
		a.waitFor("the clsact filters to go", func() bool {
			fs, err := topo.Node.NL.FilterList(eth0, parent)
			return err == nil && len(fs) == 0
		})
	}
	s.stop(t)
	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 2)
}

// tcxAvailable says whether the kernel attaches tcx programs: a trial
// attach of a program that does nothing to the loopback device of ns.
func tcxAvailable(t *testing.T, ns *topology.Netns) bool {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.SchedCLS,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
	})
	if err != nil {
		t.Fatalf("load a trial tc program: %v", err)
	}
	defer prog.Close()
	lo, err := ns.NL.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	// In ns: an ifindex names a device of the calling thread's namespace.
	err = ns.Do(func() error {
		l, err := link.AttachTCX(link.TCXOptions{Interface: lo.Attrs().Index, Program: prog, Attach: ebpf.AttachTCXEgress})
		if err != nil {
			return err
		}
		return l.Close()
	})
	return err == nil
}
