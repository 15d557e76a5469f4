package handover

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
)

// The ctnetlink messages and attributes this file writes
// (include/uapi/linux/netfilter/nfnetlink_conntrack.h). github.com/ti-mo/conntrack
// reads the table and its events, but cannot create an entry with a NAT
// binding (CTA_NAT_SRC), and sends each request on its own.
const (
	nfnlSubsysCTNetlink = 1
	ctMsgNew            = 0
	ctMsgDelete         = 2

	ctaTupleOrig  = 1
	ctaTupleReply = 2
	ctaStatus     = 3
	ctaProtoinfo  = 4
	ctaNATSrc     = 6
	ctaTimeout    = 7

	ctaTupleIP    = 1
	ctaTupleProto = 2

	ctaIPv4Src = 1
	ctaIPv4Dst = 2
	ctaIPv6Src = 3
	ctaIPv6Dst = 4

	ctaProtoNum     = 1
	ctaProtoSrcPort = 2
	ctaProtoDstPort = 3

	ctaProtoinfoTCP           = 1
	ctaProtoinfoTCPState      = 1
	ctaProtoinfoTCPFlagsOrig  = 4
	ctaProtoinfoTCPFlagsReply = 5

	ctaNATV4MinIP = 1
	ctaNATV4MaxIP = 2
	ctaNATProto   = 3
	ctaNATV6MinIP = 4
	ctaNATV6MaxIP = 5

	ctaProtoNATPortMin = 1
	ctaProtoNATPortMax = 2

	tcpConntrackEstablished = 3
	// tcpFlagBeLiberal (IP_CT_TCP_FLAG_BE_LIBERAL): conntrack takes the
	// flow's windows from its packets rather than checking them against
	// windows it never saw.
	tcpFlagBeLiberal = 0x08

	statusSeenReply = 1 << 1
	statusAssured   = 1 << 2
	// statusConfirmed: ctnetlink marks the entry it creates confirmed
	// before it applies CTA_STATUS, and refuses (EBUSY) a status that
	// would clear the bit.
	statusConfirmed = 1 << 3
)

// Lifetimes of a handed-back entry until its next packet, conntrack's
// defaults (nf_conntrack_tcp_timeout_established, _udp_timeout_stream,
// _udp_timeout).
const (
	tcpEstablishedTimeout = 5 * 24 * 3600
	udpStreamTimeout      = 120
	udpTimeout            = 30
)

// flow is one masqueraded flow: its tuple as the source sent it and the
// address and port it leaves with.
type flow struct {
	proto uint8
	src   netip.AddrPort // the source (a pod)
	dst   netip.AddrPort // the remote
	to    netip.AddrPort // the translated source
	seen  bool           // the remote has answered
}

func (f flow) String() string {
	return fmt.Sprintf("%s %s -> %s as %s", bpf.ProtoName(f.proto), f.src, f.dst, f.to)
}

// bindingOf returns the masquerade binding conntrack holds in f: a TCP or
// UDP flow whose source was translated (and nothing else: a Service's
// flow, whose destination was translated too, stays kube-proxy's). ok is
// false for anything else, and for TCP flows that are closing.
func bindingOf(f conntrack.Flow) (flow, bool) {
	o, r := f.TupleOrig, f.TupleReply
	p := o.Proto.Protocol
	if p != unix.IPPROTO_TCP && p != unix.IPPROTO_UDP || !f.Status.SrcNAT() || f.Status.DstNAT() {
		return flow{}, false
	}
	if o.IP.DestinationAddress != r.IP.SourceAddress || o.Proto.DestinationPort != r.Proto.SourcePort {
		return flow{}, false
	}
	if p == unix.IPPROTO_TCP && f.ProtoInfo.TCP != nil && f.ProtoInfo.TCP.State > tcpConntrackEstablished {
		return flow{}, false // FIN_WAIT and later: ending
	}
	b := flow{
		proto: p,
		src:   netip.AddrPortFrom(o.IP.SourceAddress.Unmap(), o.Proto.SourcePort),
		dst:   netip.AddrPortFrom(o.IP.DestinationAddress.Unmap(), o.Proto.DestinationPort),
		to:    netip.AddrPortFrom(r.IP.DestinationAddress.Unmap(), r.Proto.DestinationPort),
		seen:  f.Status.SeenReply(),
	}
	if b.src == b.to || b.src.Addr().Is4() != b.to.Addr().Is4() {
		return flow{}, false
	}
	return b, true
}

// handBackSender sends conntrack the entries of flows handed back.
type handBackSender struct {
	conn *netlink.Conn
}

func dialHandBack() (*handBackSender, error) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("open ctnetlink: %w", err)
	}
	return &handBackSender{conn: c}, nil
}

func (s *handBackSender) Close() error { return s.conn.Close() }

// handBack replaces conntrack's entry of f (the untranslated one conntrack
// made for the pair's packets, if any) by one that translates f as the pair
// does. The delete and the create go in one send, so that no packet of the
// flow comes between them on this path; if one did (the create finds an
// entry again), both are sent again.
func (s *handBackSender) handBack(f flow) error {
	del, err := ctMessage(ctMsgDelete, netlink.Request|netlink.Acknowledge, f, false)
	if err != nil {
		return err
	}
	add, err := ctMessage(ctMsgNew, netlink.Request|netlink.Acknowledge|netlink.Create|netlink.Excl, f, true)
	if err != nil {
		return err
	}
	for range 3 {
		if _, err := s.conn.SendMessages([]netlink.Message{del, add}); err != nil {
			return fmt.Errorf("hand %v back to conntrack: send: %w", f, err)
		}
		// The kernel acknowledges each message on its own, in order.
		delErr, err := s.ack()
		if err != nil {
			return fmt.Errorf("hand %v back to conntrack: %w", f, err)
		}
		addErr, err := s.ack()
		if err != nil {
			return fmt.Errorf("hand %v back to conntrack: %w", f, err)
		}
		if delErr != nil && !errors.Is(delErr, unix.ENOENT) {
			return fmt.Errorf("hand %v back to conntrack: delete the untranslated entry: %w", f, delErr)
		}
		if addErr == nil {
			return nil
		}
		if !errors.Is(addErr, unix.EEXIST) {
			return fmt.Errorf("hand %v back to conntrack: create its entry: %w", f, addErr)
		}
	}
	return fmt.Errorf("hand %v back to conntrack: its untranslated entry came back three times", f)
}

// ack reads one acknowledgment: the request's error (nil for success), or
// err when nothing could be read.
func (s *handBackSender) ack() (reqErr, err error) {
	_, err = s.conn.Receive()
	var oe *netlink.OpError
	if errors.As(err, &oe) {
		return err, nil
	}
	return nil, err
}

// ctMessage is a ctnetlink request about f: its tuple, and with nat its
// whole entry (reply tuple, state, lifetime, the source NAT to f.to).
func ctMessage(typ uint16, flags netlink.HeaderFlags, f flow, nat bool) (netlink.Message, error) {
	family := uint8(unix.AF_INET)
	if f.src.Addr().Is6() {
		family = unix.AF_INET6
	}
	ae := netlink.NewAttributeEncoder()
	ae.Nested(ctaTupleOrig, tupleAttrs(f.proto, f.src, f.dst))
	if nat {
		ae.Nested(ctaTupleReply, tupleAttrs(f.proto, f.dst, f.src))
		status := uint32(statusConfirmed)
		timeout := uint32(udpTimeout)
		if f.seen {
			status |= statusSeenReply | statusAssured
			timeout = udpStreamTimeout
		}
		if f.proto == unix.IPPROTO_TCP {
			timeout = tcpEstablishedTimeout
			ae.Nested(ctaProtoinfo, func(ae *netlink.AttributeEncoder) error {
				ae.Nested(ctaProtoinfoTCP, func(ae *netlink.AttributeEncoder) error {
					ae.Uint8(ctaProtoinfoTCPState, tcpConntrackEstablished)
					liberal := []byte{tcpFlagBeLiberal, tcpFlagBeLiberal} // struct nf_ct_tcp_flags {flags, mask}
					ae.Bytes(ctaProtoinfoTCPFlagsOrig, liberal)
					ae.Bytes(ctaProtoinfoTCPFlagsReply, liberal)
					return nil
				})
				return nil
			})
		}
		ae.Bytes(ctaStatus, be32(status))
		ae.Bytes(ctaTimeout, be32(timeout))
		ae.Nested(ctaNATSrc, func(ae *netlink.AttributeEncoder) error {
			a := f.to.Addr().AsSlice()
			if family == unix.AF_INET {
				ae.Bytes(ctaNATV4MinIP, a)
				ae.Bytes(ctaNATV4MaxIP, a)
			} else {
				ae.Bytes(ctaNATV6MinIP, a)
				ae.Bytes(ctaNATV6MaxIP, a)
			}
			ae.Nested(ctaNATProto, func(ae *netlink.AttributeEncoder) error {
				ae.Bytes(ctaProtoNATPortMin, be16(f.to.Port()))
				ae.Bytes(ctaProtoNATPortMax, be16(f.to.Port()))
				return nil
			})
			return nil
		})
	}
	attrs, err := ae.Encode()
	if err != nil {
		return netlink.Message{}, fmt.Errorf("encode the conntrack entry of %v: %w", f, err)
	}
	// struct nfgenmsg: family, version 0, resource id 0.
	data := append([]byte{family, 0, 0, 0}, attrs...)
	return netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(nfnlSubsysCTNetlink<<8 | typ), Flags: flags},
		Data:   data,
	}, nil
}

func tupleAttrs(proto uint8, src, dst netip.AddrPort) func(*netlink.AttributeEncoder) error {
	return func(ae *netlink.AttributeEncoder) error {
		ae.Nested(ctaTupleIP, func(ae *netlink.AttributeEncoder) error {
			if src.Addr().Is4() {
				ae.Bytes(ctaIPv4Src, src.Addr().AsSlice())
				ae.Bytes(ctaIPv4Dst, dst.Addr().AsSlice())
			} else {
				ae.Bytes(ctaIPv6Src, src.Addr().AsSlice())
				ae.Bytes(ctaIPv6Dst, dst.Addr().AsSlice())
			}
			return nil
		})
		ae.Nested(ctaTupleProto, func(ae *netlink.AttributeEncoder) error {
			ae.Uint8(ctaProtoNum, proto)
			ae.Bytes(ctaProtoSrcPort, be16(src.Port()))
			ae.Bytes(ctaProtoDstPort, be16(dst.Port()))
			return nil
		})
		return nil
	}
}

func be16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }
func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
