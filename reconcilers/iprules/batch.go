package iprules

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
)

// BatchTarget is a Target that writes many rules in one exchange with the
// kernel. The reconciler's batch path uses it when the Target has it.
type BatchTarget interface {
	Target
	// AddBatch installs keys as Add does and returns one error per key, in
	// the order of keys (nil: the rule is there now).
	AddBatch(keys []tables.IPRuleKey) []error
	// DelBatch removes keys as Del does, one error per key.
	DelBatch(keys []tables.IPRuleKey) []error
}

// pipelineDepth is how many requests go to the kernel in one datagram
// before their acks are read. The kernel handles them one by one and queues
// one 36-byte ack each (NETLINK_CAP_ACK), so the acks of a full datagram
// fit the default receive buffer many times over.
const pipelineDepth = 256

// ackTimeout bounds the wait for the acks of one datagram; the kernel acks
// every request that asks for it, so this only ends a wait on a lost ack.
const ackTimeout = 30 * time.Second

// pipe sends rule requests back to back on one rtnetlink socket and then
// collects their acks, matched to the requests by sequence number.
type pipe struct {
	mu  sync.Mutex
	s   *nl.NetlinkSocket
	seq uint32
}

// openPipe opens the pipeline's socket in ns (netns.None(): the calling
// thread's namespace).
func openPipe(ns netns.NsHandle) (*pipe, error) {
	s, err := nl.GetNetlinkSocketAt(ns, netns.None(), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("open rtnetlink socket: %w", err)
	}
	// Acks without a copy of the request: small and fixed in size.
	if err := unix.SetsockoptInt(s.GetFd(), unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1); err != nil {
		s.Close()
		return nil, fmt.Errorf("set NETLINK_CAP_ACK: %w", err)
	}
	tv := unix.NsecToTimeval(ackTimeout.Nanoseconds())
	if err := s.SetReceiveTimeout(&tv); err != nil {
		s.Close()
		return nil, fmt.Errorf("set receive timeout: %w", err)
	}
	return &pipe{s: s}, nil
}

// ruleMessage encodes r as one RTM_NEWRULE or RTM_DELRULE request with the
// attributes netlink.RuleAdd and RuleDel send for the rules of this package.
func ruleMessage(typ uint16, seq uint32, r *netlink.Rule) []byte {
	flags := uint16(unix.NLM_F_REQUEST | unix.NLM_F_ACK)
	if typ == unix.RTM_NEWRULE {
		flags |= unix.NLM_F_CREATE | unix.NLM_F_EXCL
	}
	hdr := nl.NewRtMsg()
	hdr.Family = uint8(r.Family)
	hdr.Protocol = unix.RTPROT_BOOT
	hdr.Scope = unix.RT_SCOPE_UNIVERSE
	hdr.Table = unix.RT_TABLE_UNSPEC
	if typ == unix.RTM_NEWRULE {
		hdr.Type = unix.RTN_UNICAST // FR_ACT_TO_TBL
	}
	if r.Table < 256 {
		hdr.Table = uint8(r.Table)
	}
	attrs := []*nl.RtAttr{}
	if r.Dst != nil {
		bits, _ := r.Dst.Mask.Size()
		hdr.Dst_len = uint8(bits)
		attrs = append(attrs, nl.NewRtAttr(unix.RTA_DST, familyBytes(r.Family, r.Dst.IP)))
	}
	if r.Src != nil {
		bits, _ := r.Src.Mask.Size()
		hdr.Src_len = uint8(bits)
		attrs = append(attrs, nl.NewRtAttr(unix.RTA_SRC, familyBytes(r.Family, r.Src.IP)))
	}
	attrs = append(attrs, nl.NewRtAttr(nl.FRA_PRIORITY, nl.Uint32Attr(uint32(r.Priority))))
	if r.Table >= 256 {
		attrs = append(attrs, nl.NewRtAttr(nl.FRA_TABLE, nl.Uint32Attr(uint32(r.Table))))
	}
	attrs = append(attrs, nl.NewRtAttr(nl.FRA_PROTOCOL, nl.Uint8Attr(uint8(r.Protocol))))

	body := hdr.Serialize()
	for _, a := range attrs {
		body = append(body, a.Serialize()...)
	}
	msg := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(body))
	nl.NativeEndian().PutUint32(msg[0:], uint32(unix.NLMSG_HDRLEN+len(body)))
	nl.NativeEndian().PutUint16(msg[4:], typ)
	nl.NativeEndian().PutUint16(msg[6:], flags)
	nl.NativeEndian().PutUint32(msg[8:], seq)
	return append(msg, body...)
}

func familyBytes(family int, ip []byte) []byte {
	if family == unix.AF_INET {
		if v4 := net.IP(ip).To4(); v4 != nil {
			return v4
		}
	}
	return net.IP(ip).To16()
}

// exchange sends one request per rule, pipelineDepth to a datagram, and
// returns the kernel's answer to each: nil, or the errno it refused with.
func (p *pipe) exchange(typ uint16, rules []*netlink.Rule) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(rules))
	for start := 0; start < len(rules); start += pipelineDepth {
		end := min(start+pipelineDepth, len(rules))
		p.exchangeOne(typ, rules[start:end], errs[start:end])
	}
	return errs
}

// exchangeOne sends rules in one datagram and fills errs from the acks.
func (p *pipe) exchangeOne(typ uint16, rules []*netlink.Rule, errs []error) {
	first := p.seq + 1
	var buf []byte
	for _, r := range rules {
		p.seq++
		buf = append(buf, ruleMessage(typ, p.seq, r)...)
	}
	setAll := func(err error) {
		for i := range errs {
			errs[i] = err
		}
	}
	if err := unix.Sendto(p.s.GetFd(), buf, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		setAll(fmt.Errorf("send %d rule requests: %w", len(rules), err))
		return
	}
	answered := make([]bool, len(rules))
	pending := len(rules)
	for pending > 0 {
		msgs, _, err := p.s.Receive()
		if err != nil {
			// The remaining acks are lost; the reconciler retries those rules.
			for i := range errs {
				if !answered[i] {
					errs[i] = fmt.Errorf("receive rule acks: %w", err)
				}
			}
			return
		}
		for _, m := range msgs {
			// Unsigned, so that a wrapped sequence number still matches and
			// a late answer to an earlier datagram is out of range.
			d := m.Header.Seq - first
			if m.Header.Type != unix.NLMSG_ERROR || d >= uint32(len(rules)) || answered[d] {
				continue // not an answer to this datagram
			}
			i := int(d)
			answered[i] = true
			pending--
			if len(m.Data) < 4 {
				errs[i] = fmt.Errorf("short netlink ack (%d bytes)", len(m.Data))
				continue
			}
			if code := int32(nl.NativeEndian().Uint32(m.Data[:4])); code != 0 {
				errs[i] = syscall.Errno(-code)
			}
		}
	}
}

// AddBatch installs keys through the pipeline. A rule the kernel already
// has is success; a wildcard rule it takes for a duplicate goes through Add,
// which tells the two apart.
func (t *netlinkTarget) AddBatch(keys []tables.IPRuleKey) []error {
	if t.pipe == nil {
		return each(keys, t.Add)
	}
	errs, rules, idx := t.prepare("add", keys)
	for j, err := range t.pipe.exchange(unix.RTM_NEWRULE, rules) {
		i := idx[j]
		switch {
		case errors.Is(err, unix.EEXIST) && wildcard(keys[i]):
			errs[i] = t.Add(keys[i])
		case err != nil && !errors.Is(err, unix.EEXIST):
			errs[i] = opError("add", keys[i], err)
		}
	}
	return errs
}

// DelBatch removes keys through the pipeline; an absent rule is success.
// Wildcard rules go through Del, which makes sure the kernel deletes
// exactly them.
func (t *netlinkTarget) DelBatch(keys []tables.IPRuleKey) []error {
	if t.pipe == nil {
		return each(keys, t.Del)
	}
	var exact []tables.IPRuleKey
	var at []int
	errs := make([]error, len(keys))
	for i, k := range keys {
		if Validate(k) == nil && wildcard(k) {
			errs[i] = t.Del(k)
			continue
		}
		exact = append(exact, k)
		at = append(at, i)
	}
	perrs, rules, idx := t.prepare("delete", exact)
	for j, err := range perrs {
		errs[at[j]] = err
	}
	for j, err := range t.pipe.exchange(unix.RTM_DELRULE, rules) {
		i := idx[j]
		if err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) {
			errs[at[i]] = opError("delete", exact[i], err)
		}
	}
	return errs
}

// prepare builds the netlink rules of keys; errs holds the keys that are
// not valid rules, idx maps each built rule back to its key.
func (t *netlinkTarget) prepare(op string, keys []tables.IPRuleKey) (errs []error, rules []*netlink.Rule, idx []int) {
	errs = make([]error, len(keys))
	for i, k := range keys {
		r, err := toRule(k)
		if err != nil {
			errs[i] = opError(op, k, err)
			continue
		}
		rules = append(rules, r)
		idx = append(idx, i)
	}
	return errs, rules, idx
}

func each(keys []tables.IPRuleKey, op func(tables.IPRuleKey) error) []error {
	errs := make([]error, len(keys))
	for i, k := range keys {
		errs[i] = op(k)
	}
	return errs
}
