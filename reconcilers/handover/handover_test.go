package handover

import (
	"encoding/binary"
	"net/netip"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

var (
	pod    = netip.MustParseAddr("10.244.1.2")
	node   = netip.MustParseAddr("10.0.0.5")
	remote = netip.MustParseAddr("203.0.113.10")
	// tcpFlow is a pod's TCP flow translated to the node's port 50000.
	tcpFlow = flow{proto: unix.IPPROTO_TCP, src: netip.AddrPortFrom(pod, 40000),
		dst: netip.AddrPortFrom(remote, 443), to: netip.AddrPortFrom(node, 50000), seen: true}
)

// inNewNetns runs the test's body on a thread in a network namespace of its
// own (its own conntrack table), and returns to the test's namespace after.
func inNewNetns(t *testing.T, fn func()) {
	t.Helper()
	privtest.Require(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // the thread is dropped, not unlocked: it stays in the namespace
		orig, err := netns.Get()
		if err != nil {
			t.Error(err)
			return
		}
		defer orig.Close()
		ns, err := netns.New()
		if err != nil {
			t.Error(err)
			return
		}
		defer ns.Close()
		fn()
	}()
	<-done
}

// TestHandBackMakesATranslatingEntry: handBack gives conntrack an entry of
// the flow with its translation (SNAT to the pair's address and port),
// replacing the untranslated one, and does it again on a second call.
func TestHandBackMakesATranslatingEntry(t *testing.T) {
	inNewNetns(t, func() {
		s, err := dialHandBack()
		if err != nil {
			t.Error(err)
			return
		}
		defer s.Close()
		for i := range 2 {
			if err := s.handBack(tcpFlow); err != nil {
				t.Errorf("hand back %d: %v", i, err)
				return
			}
			flows := dumpConntrack(t)
			if len(flows) != 1 {
				t.Errorf("hand back %d: %d conntrack entries, want 1: %v", i, len(flows), flows)
				return
			}
			b, ok := bindingOf(flows[0])
			if !ok || b.src != tcpFlow.src || b.dst != tcpFlow.dst || b.to != tcpFlow.to || !b.seen {
				t.Errorf("hand back %d: conntrack holds %+v (a binding: %v), want %v", i, flows[0], ok, tcpFlow)
			}
		}
	})
}

// loadDatapath loads the datapath with a small NAT map in the test's
// namespace, nf_conntrack loaded first (loadConntrack); nil after t.Error
// if it cannot (the caller's goroutine is not the test's: no Fatal).
func loadDatapath(t *testing.T) *bpf.Datapath {
	loadConntrack(t)
	dp, err := bpf.Load(bpf.LoadOptions{PinDir: filepath.Join(privtest.MountBPFFS(t), "ipmasq"), NATMaxEntries: 1024})
	if err != nil {
		t.Error(err)
		return nil
	}
	return dp
}

// loadConntrack has the kernel load nf_conntrack (a ctnetlink request
// does, as kube-proxy's rules do on a node) before the datapath loads: its
// conntrack kfuncs are in the module, and the programs use them only if
// they are there at load.
func loadConntrack(t *testing.T) {
	dumpConntrack(t)
}

// dumpConntrack lists the namespace's conntrack table.
func dumpConntrack(t *testing.T) []conntrack.Flow {
	c, err := conntrack.Dial(nil)
	if err != nil {
		t.Error(err)
		return nil
	}
	defer c.Close()
	flows, err := c.Dump(nil)
	if err != nil {
		t.Error(err)
	}
	return flows
}

// TestIngressLeavesConntrackItsFlows: the reply of an adopted pair passes
// the ingress program untouched while conntrack has the flow (conntrack
// translates it), and is translated by the pair once conntrack has not.
func TestIngressLeavesConntrackItsFlows(t *testing.T) {
	inNewNetns(t, func() {
		dp := loadDatapath(t)
		if dp == nil {
			return
		}
		defer dp.Close()
		if err := dp.SetLifetimes(bpf.DefaultLifetimes); err != nil {
			t.Error(err)
			return
		}
		if res, err := dp.AdoptV4(keyV4(tcpFlow), tcpFlow.to.Addr(), tcpFlow.to.Port(), true); err != nil || res != bpf.HandoverDone {
			t.Errorf("adopt: %v %v", res, err)
			return
		}
		if res, err := dp.AdoptV4(keyV4(tcpFlow), tcpFlow.to.Addr(), tcpFlow.to.Port(), true); err != nil || res != bpf.HandoverExists {
			t.Errorf("adopt again: %v %v, want exists", res, err)
			return
		}
		s, err := dialHandBack()
		if err != nil {
			t.Error(err)
			return
		}
		defer s.Close()
		if err := s.handBack(tcpFlow); err != nil {
			t.Error(err)
			return
		}
		reply := tcpFrame(tcpFlow.dst, tcpFlow.to)
		if dst := ingressDst(t, dp.Ingress, reply); dst != tcpFlow.to {
			t.Errorf("with conntrack's entry: the reply went to %v, want it untouched (%v)", dst, tcpFlow.to)
		}
		c, err := conntrack.Dial(nil)
		if err != nil {
			t.Error(err)
			return
		}
		defer c.Close()
		if err := c.Flush(); err != nil {
			t.Error(err)
			return
		}
		if dst := ingressDst(t, dp.Ingress, reply); dst != tcpFlow.src {
			t.Errorf("without conntrack's entry: the reply went to %v, want %v", dst, tcpFlow.src)
		}
	})
}

// ingressDst runs frame through prog and returns its destination after.
func ingressDst(t *testing.T, prog *ebpf.Program, frame []byte) netip.AddrPort {
	out := make([]byte, len(frame)+64)
	opts := &ebpf.RunOptions{Data: frame, DataOut: out}
	if _, err := prog.Run(opts); err != nil {
		t.Error(err) // the test's goroutine is not this one: no Fatal
		return netip.AddrPort{}
	}
	ip := opts.DataOut[14:]
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(ip[16:20])), binary.BigEndian.Uint16(ip[22:24]))
}

// tcpFrame is an Ethernet frame of an IPv4 TCP ACK from src to dst with
// valid checksums.
func tcpFrame(src, dst netip.AddrPort) []byte {
	f := make([]byte, 14+20+20)
	binary.BigEndian.PutUint16(f[12:], unix.ETH_P_IP)
	ip := f[14:34]
	ip[0], ip[8], ip[9] = 0x45, 64, unix.IPPROTO_TCP
	binary.BigEndian.PutUint16(ip[2:], 40)
	copy(ip[12:16], src.Addr().AsSlice())
	copy(ip[16:20], dst.Addr().AsSlice())
	binary.BigEndian.PutUint16(ip[10:], csum(0, ip))
	tcp := f[34:]
	binary.BigEndian.PutUint16(tcp[0:], src.Port())
	binary.BigEndian.PutUint16(tcp[2:], dst.Port())
	binary.BigEndian.PutUint32(tcp[4:], 1000)
	binary.BigEndian.PutUint32(tcp[8:], 2000)
	tcp[12], tcp[13] = 5<<4, 0x10 // ACK
	binary.BigEndian.PutUint16(tcp[14:], 65535)
	pseudo := append(append(src.Addr().AsSlice(), dst.Addr().AsSlice()...), 0, unix.IPPROTO_TCP, 0, 20)
	binary.BigEndian.PutUint16(tcp[16:], csum(csumSum(0, pseudo), tcp))
	return f
}

func csumSum(sum uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	return sum
}

func csum(sum uint32, b []byte) uint16 {
	sum = csumSum(sum, b)
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// TestBindingOf: only a forwarded flow whose source alone was translated,
// and that is not ending, is a masquerade binding to adopt.
func TestBindingOf(t *testing.T) {
	masq := conntrack.Flow{
		Status:     conntrack.StatusSrcNAT | conntrack.StatusSeenReply,
		TupleOrig:  conntrack.Tuple{IP: conntrack.IPTuple{SourceAddress: pod, DestinationAddress: remote}, Proto: conntrack.ProtoTuple{Protocol: unix.IPPROTO_TCP, SourcePort: 40000, DestinationPort: 443}},
		TupleReply: conntrack.Tuple{IP: conntrack.IPTuple{SourceAddress: remote, DestinationAddress: node}, Proto: conntrack.ProtoTuple{Protocol: unix.IPPROTO_TCP, SourcePort: 443, DestinationPort: 50000}},
		ProtoInfo:  conntrack.ProtoInfo{TCP: &conntrack.ProtoInfoTCP{State: tcpConntrackEstablished}},
	}
	if b, ok := bindingOf(masq); !ok || b != tcpFlow {
		t.Errorf("a masqueraded flow: %+v %v, want %+v", b, ok, tcpFlow)
	}
	service := masq
	service.Status |= conntrack.StatusDstNAT
	service.TupleOrig.IP.DestinationAddress = netip.MustParseAddr("10.96.0.10")
	closing := masq
	closing.ProtoInfo.TCP = &conntrack.ProtoInfoTCP{State: tcpConntrackEstablished + 1}
	plain := masq
	plain.Status = conntrack.StatusSeenReply
	plain.TupleReply.IP.DestinationAddress = pod
	plain.TupleReply.Proto.DestinationPort = 40000
	icmp := masq
	icmp.TupleOrig.Proto.Protocol = unix.IPPROTO_ICMP
	for name, f := range map[string]conntrack.Flow{"a Service's flow": service, "a closing flow": closing, "an untranslated flow": plain, "an ICMP flow": icmp} {
		if b, ok := bindingOf(f); ok {
			t.Errorf("%s is a binding: %+v", name, b)
		}
	}
}

// TestHandBackDropsTheStraySegment: a TCP segment of a flow being handed
// back that reached conntrack between the agent's delete and create got an
// entry of its own, translated by the netfilter rule to another port than
// the pair's (here made over ctnetlink: the flow's tuple to the node's port
// 61234). The egress program drops that segment while the flow's hand-back
// is noted, and only that one: the pair's own port, a port conntrack has no
// entry for, another flow's entry to the same remote and, once the notes
// are cleared, the stray itself all pass.
func TestHandBackDropsTheStraySegment(t *testing.T) {
	inNewNetns(t, func() {
		dp := loadDatapath(t)
		if dp == nil {
			return
		}
		defer dp.Close()
		if ok, err := bpf.ConntrackLookupAvailable(); err != nil || !ok {
			t.Errorf("the kernel's conntrack kfuncs (bpf_skb_ct_lookup, 5.18, nf_conntrack loaded): %v %v; the hand-back cannot run here", ok, err)
			return
		}
		s, err := dialHandBack()
		if err != nil {
			t.Error(err)
			return
		}
		defer s.Close()
		stray := tcpFlow
		stray.to = netip.AddrPortFrom(node, 61234)
		other := flow{proto: unix.IPPROTO_TCP, src: netip.AddrPortFrom(netip.MustParseAddr("10.244.1.3"), 40000),
			dst: tcpFlow.dst, to: netip.AddrPortFrom(node, 61236), seen: true}
		for _, f := range []flow{stray, other} {
			if err := s.handBack(f); err != nil {
				t.Error(err)
				return
			}
		}
		if err := dp.NoteHandBackV4(keyV4(tcpFlow), tcpFlow.to.Port()); err != nil {
			t.Error(err)
			return
		}
		const shot = 2 // TC_ACT_SHOT
		for _, c := range []struct {
			what string
			from netip.AddrPort
			drop bool
		}{
			{"the stray segment", stray.to, true},
			{"the pair's own port", tcpFlow.to, false},
			{"a port conntrack has no entry for", netip.AddrPortFrom(node, 61235), false},
			{"another flow's entry to the same remote", other.to, false},
		} {
			if got := runEgress(t, dp, tcpFrame(c.from, tcpFlow.dst)) == shot; got != c.drop {
				t.Errorf("%s (%v): dropped %v, want %v", c.what, c.from, got, c.drop)
			}
		}
		if err := dp.ClearHandBacks(); err != nil {
			t.Error(err)
			return
		}
		if runEgress(t, dp, tcpFrame(stray.to, tcpFlow.dst)) == shot {
			t.Error("the stray segment after the notes were cleared: dropped, want it passed")
		}
		counts, err := bpf.ReadCounters(dp.Maps.Counters)
		if err != nil {
			t.Error(err)
			return
		}
		if n := counts[bpf.CounterDropHandback]; n != 1 {
			t.Errorf("drop-handback counted %d, want 1", n)
		}
	})
}

// runEgress runs frame through the egress program and returns its verdict.
func runEgress(t *testing.T, dp *bpf.Datapath, frame []byte) uint32 {
	return runProgram(t, dp.Egress, frame)
}

// TestHandBackDropsTheReplyInItsWindow: while a flow is handed back and
// conntrack has no translating entry of it yet (after the agent's delete,
// before its create), the ingress program drops the flow's TCP replies
// rather than translating them (conntrack would make an entry whose port
// clashes with the agent's); another flow's reply to the same remote is
// translated, and once conntrack has the entry the reply is left to it.
func TestHandBackDropsTheReplyInItsWindow(t *testing.T) {
	inNewNetns(t, func() {
		dp := loadDatapath(t)
		if dp == nil {
			return
		}
		defer dp.Close()
		if ok, err := bpf.ConntrackLookupAvailable(); err != nil || !ok {
			t.Errorf("the kernel's conntrack kfuncs (bpf_skb_ct_lookup, 5.18, nf_conntrack loaded): %v %v; the hand-back cannot run here", ok, err)
			return
		}
		if err := dp.SetLifetimes(bpf.DefaultLifetimes); err != nil {
			t.Error(err)
			return
		}
		other := flow{proto: unix.IPPROTO_TCP, src: netip.AddrPortFrom(netip.MustParseAddr("10.244.1.3"), 40000),
			dst: tcpFlow.dst, to: netip.AddrPortFrom(node, 61236), seen: true}
		// Both pairs conntrack's (as marked by a pass), neither in
		// conntrack: the instant between the delete and the create.
		for _, f := range []flow{tcpFlow, other} {
			if res, err := dp.AdoptV4(keyV4(f), f.to.Addr(), f.to.Port(), true); err != nil || res != bpf.HandoverDone {
				t.Errorf("adopt %v: %v %v", f, res, err)
				return
			}
		}
		if err := dp.NoteHandBackV4(keyV4(tcpFlow), tcpFlow.to.Port()); err != nil {
			t.Error(err)
			return
		}
		const shot = 2 // TC_ACT_SHOT
		reply := tcpFrame(tcpFlow.dst, tcpFlow.to)
		if v := runProgram(t, dp.Ingress, reply); v != shot {
			t.Errorf("the handed-back flow's reply before conntrack's entry: verdict %d, want dropped (%d)", v, shot)
		}
		if dst := ingressDst(t, dp.Ingress, tcpFrame(other.dst, other.to)); dst != other.src {
			t.Errorf("another flow's reply to the same remote went to %v, want %v", dst, other.src)
		}
		s, err := dialHandBack()
		if err != nil {
			t.Error(err)
			return
		}
		defer s.Close()
		if err := s.handBack(tcpFlow); err != nil {
			t.Error(err)
			return
		}
		if dst := ingressDst(t, dp.Ingress, reply); dst != tcpFlow.to {
			t.Errorf("with conntrack's entry: the reply went to %v, want it untouched (%v)", dst, tcpFlow.to)
		}
		// The notes cleared and conntrack's entry gone: the pair
		// translates the flow again.
		if err := dp.ClearHandBacks(); err != nil {
			t.Error(err)
			return
		}
		c, err := conntrack.Dial(nil)
		if err != nil {
			t.Error(err)
			return
		}
		defer c.Close()
		if err := c.Flush(); err != nil {
			t.Error(err)
			return
		}
		if dst := ingressDst(t, dp.Ingress, reply); dst != tcpFlow.src {
			t.Errorf("after the hand-back, without conntrack's entry: the reply went to %v, want %v", dst, tcpFlow.src)
		}
		counts, err := bpf.ReadCounters(dp.Maps.Counters)
		if err != nil {
			t.Error(err)
			return
		}
		if n := counts[bpf.CounterDropHandback]; n != 1 {
			t.Errorf("drop-handback counted %d, want 1", n)
		}
	})
}

// TestHandBackWaitsForUDPAnswers: a UDP pair still waiting for its answer
// is left to a later pass, unless it has waited awaitAnswer; TCP pairs and
// answered UDP pairs go now; pairs conntrack has, half pairs and ending
// flows never.
func TestHandBackWaitsForUDPAnswers(t *testing.T) {
	const now = uint64(100 * time.Second)
	young, old := now-uint64(10*time.Millisecond), now-uint64(awaitAnswer)
	pair := func(proto, flags uint8, created uint64) *bpf.NATPair {
		return &bpf.NATPair{Kind: bpf.KindMasquerade, Proto: proto, Flags: flags, CreatedNs: created}
	}
	for _, c := range []struct {
		what string
		p    *bpf.NATPair
		want bool
	}{
		{"a UDP query waiting for its answer", pair(unix.IPPROTO_UDP, 0, young), false},
		{"a UDP query unanswered for awaitAnswer", pair(unix.IPPROTO_UDP, 0, old), true},
		{"an answered UDP pair", pair(unix.IPPROTO_UDP, bpf.NATFlagSeen, young), true},
		{"a new TCP pair", pair(unix.IPPROTO_TCP, 0, young), true},
		{"a pair conntrack has", &bpf.NATPair{Kind: bpf.KindMasquerade, Proto: unix.IPPROTO_TCP, Conntrack: true}, false},
		{"a pair without its reply entry", &bpf.NATPair{Kind: bpf.KindMasquerade, Proto: unix.IPPROTO_TCP, ReplyMissing: true}, false},
		{"a closing TCP pair", pair(unix.IPPROTO_TCP, bpf.NATFlagFIN, old), false},
		{"an inbound record", &bpf.NATPair{Kind: bpf.KindInbound, Proto: unix.IPPROTO_TCP}, false},
	} {
		if got := handBackNow(c.p, now); got != c.want {
			t.Errorf("%s: handed back now %v, want %v", c.what, got, c.want)
		}
	}
}

// runProgram runs frame through prog and returns its verdict.
func runProgram(t *testing.T, prog *ebpf.Program, frame []byte) uint32 {
	opts := &ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+64)}
	ret, err := prog.Run(opts)
	if err != nil {
		t.Error(err)
	}
	return ret
}
