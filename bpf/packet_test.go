package bpf

import (
	"encoding/binary"
	"net/netip"
	"testing"
)

// Packet building and checking for the datapath tests: Ethernet + IPv4/IPv6
// + TCP/UDP/ICMP with correct checksums, and a parser that verifies them.

const (
	protoICMP   = 1
	protoTCP    = 6
	protoUDP    = 17
	protoICMPv6 = 58

	tcpSYN = 0x02
	tcpACK = 0x10
	tcpFIN = 0x01
	tcpRST = 0x04
)

// flow describes one packet to build.
type flow struct {
	src, dst     netip.Addr
	proto        uint8
	sport, dport uint16 // ICMP echo: sport is the identifier
	icmpType     uint8  // ICMP/ICMPv6 echo request or reply
	tcpFlags     uint8  // 0: a SYN, the packet that starts a flow
	seq, ack     uint32 // TCP: seq 0 is sent as 1000
	zeroUDPCsum  bool
	payload      []byte
	ipID         uint16
	fragOff      uint16 // IPv4 flags+offset field (host order)
}

func csumAdd(sum uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	return sum
}

func csumFold(sum uint32) uint16 {
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

func pseudoSum(src, dst netip.Addr, proto uint8, length int) uint32 {
	var sum uint32
	sum = csumAdd(sum, src.AsSlice())
	sum = csumAdd(sum, dst.AsSlice())
	sum += uint32(proto) + uint32(length)
	return sum
}

// l4 builds the L4 header and payload with its checksum.
func (f flow) l4() []byte {
	var b []byte
	switch f.proto {
	case protoTCP:
		b = make([]byte, 20)
		binary.BigEndian.PutUint16(b[0:], f.sport)
		binary.BigEndian.PutUint16(b[2:], f.dport)
		seq := f.seq
		if seq == 0 {
			seq = 1000
		}
		binary.BigEndian.PutUint32(b[4:], seq)
		binary.BigEndian.PutUint32(b[8:], f.ack)
		b[12] = 5 << 4
		b[13] = f.tcpFlags
		if f.tcpFlags == 0 {
			b[13] = tcpSYN
		}
		binary.BigEndian.PutUint16(b[14:], 65535)
	case protoUDP:
		b = make([]byte, 8)
		binary.BigEndian.PutUint16(b[0:], f.sport)
		binary.BigEndian.PutUint16(b[2:], f.dport)
	case protoICMP, protoICMPv6:
		b = make([]byte, 8)
		b[0] = f.icmpType
		binary.BigEndian.PutUint16(b[4:], f.sport)
		binary.BigEndian.PutUint16(b[6:], 7) // sequence
	}
	b = append(b, f.payload...)
	if b == nil {
		return make([]byte, 8) // another protocol: opaque bytes
	}
	if f.proto == protoUDP {
		binary.BigEndian.PutUint16(b[4:], uint16(len(b)))
	}
	var sum uint32
	if f.proto != protoICMP {
		sum = pseudoSum(f.src, f.dst, f.proto, len(b))
	}
	c := csumFold(csumAdd(sum, b))
	switch f.proto {
	case protoTCP:
		binary.BigEndian.PutUint16(b[16:], c)
	case protoUDP:
		if f.zeroUDPCsum {
			c = 0
		} else if c == 0 {
			c = 0xffff
		}
		binary.BigEndian.PutUint16(b[6:], c)
	default:
		binary.BigEndian.PutUint16(b[2:], c)
	}
	return b
}

// ipPacket wraps an L4 payload in an IPv4 or IPv6 header.
func ipPacket(src, dst netip.Addr, proto uint8, id, fragOff uint16, l4 []byte) []byte {
	if src.Is4() {
		h := make([]byte, 20)
		h[0] = 0x45
		binary.BigEndian.PutUint16(h[2:], uint16(20+len(l4)))
		binary.BigEndian.PutUint16(h[4:], id)
		binary.BigEndian.PutUint16(h[6:], fragOff)
		h[8] = 64
		h[9] = proto
		copy(h[12:], src.AsSlice())
		copy(h[16:], dst.AsSlice())
		binary.BigEndian.PutUint16(h[10:], csumFold(csumAdd(0, h)))
		return append(h, l4...)
	}
	h := make([]byte, 40)
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(l4)))
	h[6] = proto
	h[7] = 64
	copy(h[8:], src.AsSlice())
	copy(h[24:], dst.AsSlice())
	return append(h, l4...)
}

func ether(ip []byte) []byte {
	e := make([]byte, 14, 14+len(ip))
	copy(e[0:], []byte{2, 0, 0, 0, 0, 1})
	copy(e[6:], []byte{2, 0, 0, 0, 0, 2})
	if ip[0]>>4 == 4 {
		binary.BigEndian.PutUint16(e[12:], 0x0800)
	} else {
		binary.BigEndian.PutUint16(e[12:], 0x86dd)
	}
	return append(e, ip...)
}

// packet builds the Ethernet frame of f.
func (f flow) packet() []byte {
	return ether(ipPacket(f.src, f.dst, f.proto, f.ipID, f.fragOff, f.l4()))
}

// parsed is what the checks read back from a packet.
type parsed struct {
	src, dst     netip.Addr
	proto        uint8
	sport, dport uint16 // ICMP echo: sport = identifier
	l3, l4       []byte // headers onwards (l4 to the end of the packet)
}

// parseIP reads an IP packet (no Ethernet header) and checks the IPv4
// header checksum.
func parseIP(t *testing.T, ip []byte) parsed {
	t.Helper()
	var p parsed
	p.l3 = ip
	switch ip[0] >> 4 {
	case 4:
		ihl := int(ip[0]&0xf) * 4
		if got := csumFold(csumAdd(0, ip[:ihl])); got != 0 {
			t.Fatalf("IPv4 header checksum invalid (residue %#x)", got)
		}
		p.src = netip.AddrFrom4([4]byte(ip[12:16]))
		p.dst = netip.AddrFrom4([4]byte(ip[16:20]))
		p.proto = ip[9]
		p.l4 = ip[ihl:]
	case 6:
		p.src = netip.AddrFrom16([16]byte(ip[8:24]))
		p.dst = netip.AddrFrom16([16]byte(ip[24:40]))
		p.proto = ip[6]
		p.l4 = ip[40:]
	default:
		t.Fatalf("not an IP packet: %x", ip)
	}
	if len(p.l4) >= 4 {
		switch p.proto {
		case protoTCP, protoUDP:
			p.sport = binary.BigEndian.Uint16(p.l4[0:])
			p.dport = binary.BigEndian.Uint16(p.l4[2:])
		case protoICMP, protoICMPv6:
			if len(p.l4) >= 6 {
				p.sport = binary.BigEndian.Uint16(p.l4[4:])
			}
		}
	}
	return p
}

// parse reads an Ethernet frame and checks every checksum of a complete
// (unfragmented) packet.
func parse(t *testing.T, frame []byte) parsed {
	t.Helper()
	p := parseIP(t, frame[14:])
	checkL4(t, p)
	return p
}

// checkL4 verifies the L4 checksum of a complete segment (zero UDP checksum
// is accepted as "none").
func checkL4(t *testing.T, p parsed) {
	t.Helper()
	var sum uint32
	if p.proto != protoICMP {
		sum = pseudoSum(p.src, p.dst, p.proto, len(p.l4))
	}
	if p.proto == protoUDP && binary.BigEndian.Uint16(p.l4[6:]) == 0 {
		return
	}
	if got := csumFold(csumAdd(sum, p.l4)); got != 0 {
		t.Fatalf("L4 (proto %d) checksum invalid (residue %#x) in %x", p.proto, got, p.l4)
	}
}
