package bpf

import (
	"fmt"
	"strconv"
	"time"
)

// Lifetimes are how long a NAT pair (or an inbound flow record) lives
// without a packet, per connection state, as conntrack's timeouts are. The
// programs apply them when a SYN meets an old pair and when a NAT port is
// wanted; the agent's collector applies the same ones to free memory.
type Lifetimes struct {
	// TCPSyn: a TCP flow whose SYN was not answered yet.
	TCPSyn time.Duration
	// TCPEstablished: an answered TCP flow without FIN or RST.
	TCPEstablished time.Duration
	// TCPClosing: a TCP flow after a FIN from either side. It covers the
	// server's TIME_WAIT, so the pair's port is not handed to another
	// source's new connection to the same server while the server may still
	// hold the old one (its SYN would be dropped, PAWS).
	TCPClosing time.Duration
	// TCPReset: a TCP flow after a RST.
	TCPReset time.Duration
	// UDP: a UDP flow not answered yet, or a query and its answer (as
	// conntrack's unreplied and replied-once flows).
	UDP time.Duration
	// UDPStream: a UDP stream: answered, and still active 2 s after it
	// started (conntrack's stream_ts).
	UDPStream time.Duration
	// ICMP: an ICMP echo flow.
	ICMP time.Duration
	// Other: SCTP and address-only pairs (GRE, ESP and other protocols).
	Other time.Duration
}

// DefaultLifetimes are conntrack's and Cilium's orders of magnitude: an
// unanswered SYN 60 s (Cilium; conntrack 120 s), established TCP 5 days
// (conntrack's nf_conntrack_tcp_timeout_established, 432000 s: a pooled
// connection idle for hours, keepalives off, keeps its pair and NAT port
// as it does under MASQUERADE; Cilium's 6 h would end it, and its next
// segment would be picked up on another port and reset by the server),
// closing 2 min (conntrack's TIME_WAIT), reset
// 10 s (conntrack's CLOSE), UDP 30 s one way or a query and its answer,
// 2 min a stream answered and active for 2 s (conntrack),
// ICMP 30 s (conntrack), other protocols 10 min (conntrack's generic
// timeout).
var DefaultLifetimes = Lifetimes{
	TCPSyn:         60 * time.Second,
	TCPEstablished: 5 * 24 * time.Hour,
	TCPClosing:     2 * time.Minute,
	TCPReset:       10 * time.Second,
	UDP:            30 * time.Second,
	UDPStream:      2 * time.Minute,
	ICMP:           30 * time.Second,
	Other:          10 * time.Minute,
}

// NATState is a connection state (enum nat_state in lib/types.h).
type NATState uint32

// Connection states.
const (
	StateTCPSyn         = NATState(masqNatStateNAT_TCP_SYN)
	StateTCPEstablished = NATState(masqNatStateNAT_TCP_ESTABLISHED)
	StateTCPClosing     = NATState(masqNatStateNAT_TCP_CLOSING)
	StateTCPReset       = NATState(masqNatStateNAT_TCP_RESET)
	StateUDP            = NATState(masqNatStateNAT_UDP)
	StateUDPStream      = NATState(masqNatStateNAT_UDP_STREAM)
	StateICMP           = NATState(masqNatStateNAT_ICMP)
	StateOther          = NATState(masqNatStateNAT_OTHER)
	numStates           = NATState(masqNatStateNAT_STATE_MAX)
)

var stateNames = [numStates]string{
	StateTCPSyn: "tcp-syn", StateTCPEstablished: "tcp-established", StateTCPClosing: "tcp-closing",
	StateTCPReset: "tcp-reset", StateUDP: "udp", StateUDPStream: "udp-stream", StateICMP: "icmp",
	StateOther: "other",
}

func (s NATState) String() string {
	if s < numStates {
		return stateNames[s]
	}
	return fmt.Sprintf("state-%d", uint32(s))
}

// IP protocol numbers of NAT keys.
const (
	ProtoICMP   = 1
	ProtoTCP    = 6
	ProtoUDP    = 17
	ProtoICMPv6 = 58
	ProtoSCTP   = 132
)

// ProtoName is the name of an IP protocol number as the listings and the
// logs show it.
func ProtoName(p uint8) string {
	switch p {
	case ProtoTCP:
		return "tcp"
	case ProtoUDP:
		return "udp"
	case ProtoICMP:
		return "icmp"
	case ProtoICMPv6:
		return "icmpv6"
	case ProtoSCTP:
		return "sctp"
	}
	return "proto-" + strconv.Itoa(int(p)) // address-only: GRE 47, ESP 50, ...
}

// StateOf is the state of a pair from the flags of both its directions
// (or of an inbound record's), as the programs derive it: nat_state() in
// lib/flow.h, to which TestStateOfIsNatState holds it for every protocol
// and flags byte.
func StateOf(proto, flags uint8) NATState {
	switch proto {
	case ProtoTCP:
		switch {
		case flags&NATFlagRST != 0:
			return StateTCPReset
		case flags&NATFlagFIN != 0:
			return StateTCPClosing
		case flags&NATFlagSeen != 0:
			return StateTCPEstablished
		}
		return StateTCPSyn
	case ProtoUDP:
		if flags&NATFlagStream != 0 {
			return StateUDPStream
		}
		return StateUDP
	case ProtoICMP, ProtoICMPv6:
		return StateICMP
	}
	return StateOther
}

// Of returns the lifetime of a state.
func (l Lifetimes) Of(s NATState) time.Duration {
	return l.array()[s]
}

func (l Lifetimes) array() [numStates]time.Duration {
	return [numStates]time.Duration{
		StateTCPSyn: l.TCPSyn, StateTCPEstablished: l.TCPEstablished, StateTCPClosing: l.TCPClosing,
		StateTCPReset: l.TCPReset, StateUDP: l.UDP, StateUDPStream: l.UDPStream, StateICMP: l.ICMP,
		StateOther: l.Other,
	}
}

// Validate says which lifetime is not positive.
func (l Lifetimes) Validate() error {
	for s, d := range l.array() {
		if d <= 0 {
			return fmt.Errorf("lifetime of state %s is %s: want a positive duration", NATState(s), d)
		}
	}
	return nil
}

// SetLifetimes writes the lifetimes the programs apply.
func (d *Datapath) SetLifetimes(l Lifetimes) error {
	if err := l.Validate(); err != nil {
		return err
	}
	return d.updateConfig(func(c *Config) {
		for s, dur := range l.array() {
			c.TimeoutNs[s] = uint64(dur)
		}
	})
}

func (d *Datapath) updateConfig(change func(*Config)) error {
	var c Config
	if err := d.Maps.Config.Lookup(uint32(0), &c); err != nil {
		return fmt.Errorf("read datapath config: %w", err)
	}
	change(&c)
	if err := d.Maps.Config.Put(uint32(0), c); err != nil {
		return fmt.Errorf("write datapath config: %w", err)
	}
	return nil
}
