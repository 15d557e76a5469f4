package e2e

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// Protocols without ports, and SCTP, over raw sockets: the pod sends, a
// responder on the remote answers to whatever source it saw, and the pod
// must get the answer. The responder records the sources.

const (
	protoGRE  = 47
	protoESP  = 50
	protoSCTP = 132
	protoExp  = 253 // RFC 3692 experimentation
)

// TestOtherProtocols: IP protocol 253, GRE and ESP (address-only) and SCTP
// (with ports) from a pod reach the remote from the node's address and the
// remote's answer reaches the pod, IPv4 and IPv6.
func TestOtherProtocols(t *testing.T) {
	spec := setupSpec{config: masqueradeAll, sources: podSources}
	cases := []struct {
		proto  int
		remote netip.Addr
		node   netip.Addr
	}{
		{protoExp, topology.RemoteIP4, topology.NodeIP4},
		{protoGRE, topology.RemoteIP4, topology.NodeIP4},
		{protoESP, topology.RemoteIP4, topology.NodeIP4},
		{protoSCTP, topology.RemoteIP4, topology.NodeIP4},
		{protoExp, topology.RemoteIP6, topology.NodeIP6},
		{protoESP, topology.RemoteIP6, topology.NodeIP6},
		{protoSCTP, topology.RemoteIP6, topology.NodeIP6},
	}
	underBoth(t, spec, func(t *testing.T, s *scenario) {
		for _, c := range cases {
			r := startResponder(t, s.topo.Ext, c.proto, c.remote)
			if err := rawExchange(s.topo.Pod, c.proto, c.remote); err != nil {
				t.Errorf("protocol %d to %s: %v", c.proto, c.remote, err)
			}
			for _, src := range r.sources() {
				if src != c.node {
					t.Errorf("protocol %d: the remote saw %s, want %s", c.proto, src, c.node)
				}
			}
		}
		if a := s.agent; a != nil {
			if n := a.counter(bpf.CounterNATNewAddrOnly); n != 5 {
				t.Errorf("nat-new-address-only = %d, want 5 (one pair per flow); the pairs:\n%s", n, natCommand(t, a))
			}
			if n := a.counter(bpf.CounterNATNewSCTP); n != 2 {
				t.Errorf("nat-new-sctp = %d, want 2", n)
			}
		}
	})
}

// payloadFor is what the pod sends for a protocol: an SCTP INIT (so that
// Linux conntrack, the reference, tracks it), a GRE header with a payload,
// an ESP-shaped SPI and sequence number, or bytes.
func payloadFor(proto int, sport, dport uint16) []byte {
	switch proto {
	case protoSCTP:
		return sctpChunk(sport, dport, 0, 1)
	case protoGRE:
		return append([]byte{0, 0, 0x08, 0x00}, []byte("ipmasq GRE payload")...)
	case protoESP:
		return append([]byte{0, 0, 0x12, 0x34, 0, 0, 0, 1}, []byte("ipmasq ESP payload")...)
	}
	return []byte("ipmasq protocol 253")
}

// sctpChunk builds an SCTP packet with an INIT (1) or INIT ACK (2) chunk
// and its CRC32c. vtag is 0 for an INIT, the peer's initiate tag after.
func sctpChunk(sport, dport uint16, vtag uint32, chunk byte) []byte {
	b := make([]byte, 32)
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	binary.BigEndian.PutUint32(b[4:], vtag)
	b[12] = chunk
	binary.BigEndian.PutUint16(b[14:], 20)
	binary.BigEndian.PutUint32(b[16:], 0x1badcafe) // initiate tag
	binary.BigEndian.PutUint32(b[20:], 65536)      // a_rwnd
	binary.BigEndian.PutUint16(b[24:], 1)          // outbound streams
	binary.BigEndian.PutUint16(b[26:], 1)          // inbound streams
	binary.BigEndian.PutUint32(b[28:], 1)          // initial TSN
	binary.LittleEndian.PutUint32(b[8:], crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)))
	return b
}

func sctpValid(b []byte) bool {
	if len(b) < 12 {
		return false
	}
	c := bytes.Clone(b)
	want := binary.LittleEndian.Uint32(c[8:])
	clear(c[8:12])
	return crc32.Checksum(c, crc32.MakeTable(crc32.Castagnoli)) == want
}

func network(proto int, a netip.Addr) string {
	if a.Is4() {
		return fmt.Sprintf("ip4:%d", proto)
	}
	return fmt.Sprintf("ip6:%d", proto)
}

// responder answers every packet of a protocol sent to addr: SCTP with an
// INIT ACK to the source port, the others with the same payload.
type responder struct {
	mu   sync.Mutex
	seen []netip.Addr
}

func (r *responder) sources() []netip.Addr {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]netip.Addr(nil), r.seen...)
}

func startResponder(t *testing.T, n *topology.Netns, proto int, addr netip.Addr) *responder {
	t.Helper()
	var c net.PacketConn
	if err := n.Do(func() (err error) { c, err = net.ListenPacket(network(proto, addr), addr.String()); return err }); err != nil {
		t.Fatalf("raw socket for protocol %d in %s: %v", proto, n.Name, err)
	}
	t.Cleanup(func() { c.Close() })
	r := &responder{}
	go func() {
		buf := make([]byte, 65536)
		for {
			m, from, err := c.ReadFrom(buf)
			if err != nil {
				return
			}
			src, _ := netip.AddrFromSlice(from.(*net.IPAddr).IP)
			r.mu.Lock()
			r.seen = append(r.seen, src.Unmap())
			r.mu.Unlock()
			answer := bytes.Clone(buf[:m])
			if proto == protoSCTP {
				if !sctpValid(answer) || answer[12] != 1 {
					continue // not an INIT with a valid CRC32c
				}
				answer = sctpChunk(binary.BigEndian.Uint16(answer[2:]), binary.BigEndian.Uint16(answer[0:]), 0x1badcafe, 2)
			}
			c.WriteTo(answer, from)
		}
	}()
	return r
}

// rawExchange sends the protocol's payload from the pod to remote and waits
// for the answer (three tries).
func rawExchange(pod *topology.Netns, proto int, remote netip.Addr) error {
	var c net.PacketConn
	laddr := "0.0.0.0"
	if remote.Is6() {
		laddr = "::"
	}
	if err := pod.Do(func() (err error) { c, err = net.ListenPacket(network(proto, remote), laddr); return err }); err != nil {
		return err
	}
	defer c.Close()
	const sport, dport = 40123, 38412
	out := payloadFor(proto, sport, dport)
	buf := make([]byte, 65536)
	for try := 0; try < 3; try++ {
		if _, err := c.WriteTo(out, &net.IPAddr{IP: remote.AsSlice()}); err != nil {
			return err
		}
		deadline := time.Now().Add(time.Second)
		for time.Now().Before(deadline) {
			c.SetReadDeadline(deadline)
			m, from, err := c.ReadFrom(buf)
			if err != nil {
				break
			}
			if src, _ := netip.AddrFromSlice(from.(*net.IPAddr).IP); src.Unmap() != remote {
				continue
			}
			got := buf[:m]
			if proto != protoSCTP {
				if bytes.Equal(got, out) {
					return nil
				}
				continue
			}
			if !sctpValid(got) {
				return fmt.Errorf("the INIT ACK reached the pod with a bad CRC32c")
			}
			if got[12] == 2 && binary.BigEndian.Uint16(got[2:]) == sport && binary.BigEndian.Uint16(got[0:]) == dport {
				return nil
			}
		}
	}
	return fmt.Errorf("no answer reached the pod")
}
