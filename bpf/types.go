package bpf

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
)

// Map value and key types, as laid out in lib/types.h. Addresses and ports
// are in network byte order: use [Addr4], [Port] and [HostPort] to convert.
type (
	// EgressDev is a value of egress_devs (key: ifindex).
	EgressDev = masqEgressDev
	// Config is the single value of config, in host byte order.
	Config = masqMasqConfig
	// NATKeyV4 is a key of nat_v4.
	NATKeyV4 = masqNatV4Key
	// NATValV4 is a value of nat_v4.
	NATValV4 = masqNatV4Val
	// NATKeyV6 is a key of nat_v6.
	NATKeyV6 = masqNatV6Key
	// NATValV6 is a value of nat_v6.
	NATValV6 = masqNatV6Val
	// UnmasqVal is a value of unmasq_v4 (key NATKeyV4) and unmasq_v6
	// (key NATKeyV6): a flow that started unmasqueraded.
	UnmasqVal = masqUnmasqVal
	// NATCandV4 is a slot of nat_cand_v4: a noted candidate for early
	// drop, at its key's hash (lib/evict.h).
	NATCandV4 = masqNatV4Cand
)

// NAT directions (NATKey*.Dir): enum nat_dir in lib/types.h.
const (
	DirEgress  = uint8(masqNatDirDIR_EGRESS)  // the pod's tuple → SNAT address and NAT port
	DirIngress = uint8(masqNatDirDIR_INGRESS) // the reply tuple → pod address and port
	// DirInbound records a flow a remote opened toward a masquerade source,
	// keyed by the source's reply tuple; its replies are not translated.
	DirInbound = uint8(masqNatDirDIR_INBOUND)
)

// NAT entry flags (NATVal*.Flags), set by the direction that saw them:
// enum nat_flag in lib/types.h.
const (
	NATFlagFIN = uint8(masqNatFlagNAT_F_FIN)
	NATFlagRST = uint8(masqNatFlagNAT_F_RST)
	// NATFlagSeen: the reply direction (or an inbound flow's source) has
	// sent a packet, the flow is answered.
	NATFlagSeen = uint8(masqNatFlagNAT_F_SEEN)
	// NATFlagHost marks a dir-1 entry that holds a node flow's reply tuple
	// (a node socket's port in the NAT range), so no NAT pair takes it.
	NATFlagHost = uint8(masqNatFlagNAT_F_HOST)
	// NATFlagClosedFirst marks a dir-0 entry whose source sent the
	// connection's first FIN and whose remote's FIN acknowledged it: the
	// remote closed passively and holds no TIME_WAIT, so the closed pair's
	// port may go to another source (crossing FINs are not marked).
	NATFlagClosedFirst = uint8(masqNatFlagNAT_F_CLOSED_FIRST)
	// NATFlagStream marks a UDP pair's dir-1 entry once the flow was
	// answered and still active 2 s after it started: a stream, which
	// lives the replied lifetime (conntrack's stream_ts); a query and its
	// answer live the short one.
	NATFlagStream = uint8(masqNatFlagNAT_F_STREAM)
)

// Addr4 returns an IPv4 address as the uint32 the maps hold (network byte
// order bytes in memory).
func Addr4(a netip.Addr) uint32 {
	b := a.Unmap().As4()
	return binary.NativeEndian.Uint32(b[:])
}

// AddrFrom4 is the inverse of Addr4.
func AddrFrom4(v uint32) netip.Addr {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

// Port returns a port as the uint16 the maps hold (network byte order).
func Port(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

// HostPort is the inverse of Port.
func HostPort(v uint16) uint16 { return Port(v) }

// SetPortRange sets the NAT port range (ICMP echo identifiers use it too).
func (d *Datapath) SetPortRange(min, max uint16) error {
	return d.SetPortRanges([][2]uint16{{min, max}})
}

// SetPortRanges sets the NAT port ranges ({min, max} each, 1 <= min <= max;
// any number, in any order, overlapping or not): the datapath takes their
// union. With several, a new flow's search walks the union from a random
// index, so a port is as likely as under the Kubernetes agent's one
// MASQUERADE --to-ports rule per range, each taking its share of the new
// connections (lib/ports.h). The ports are written before the config
// that counts them, so a program running meanwhile finds ports of either
// set, or none (an index of no port is skipped).
func (d *Datapath) SetPortRanges(ranges [][2]uint16) error {
	if len(ranges) == 0 {
		return fmt.Errorf("NAT port ranges: want at least one")
	}
	var set [65536 / 64]uint64
	for _, r := range ranges {
		if r[0] == 0 || r[1] < r[0] {
			return fmt.Errorf("NAT port range %d-%d: want 1 <= min <= max", r[0], r[1])
		}
		for p := uint32(r[0]); p <= uint32(r[1]); p++ {
			set[p/64] |= 1 << (p % 64)
		}
	}
	var (
		blocks          [65536 / NATPortsBlock]NATPortBlock
		total, runs     uint32
		lo, hi          uint16
		inRun, anyFound bool
	)
	for p := uint32(1); p < 65536; p++ {
		if set[p/64]&(1<<(p%64)) == 0 {
			inRun = false
			continue
		}
		if !inRun {
			runs++
			inRun = true
		}
		if !anyFound {
			lo, anyFound = uint16(p), true
		}
		hi = uint16(p)
		blocks[total/uint32(NATPortsBlock)].Port[total%uint32(NATPortsBlock)] = uint16(p)
		total++
	}
	if runs > 1 {
		keys := make([]uint32, len(blocks))
		for i := range keys {
			keys[i] = uint32(i)
		}
		if _, err := d.Maps.NatPorts.BatchUpdate(keys, blocks[:], nil); err != nil {
			return fmt.Errorf("write NAT ports: %w", err)
		}
		keys = make([]uint32, len(set))
		for i := range keys {
			keys[i] = uint32(i)
		}
		if _, err := d.Maps.NatPortSet.BatchUpdate(keys, set[:], nil); err != nil {
			return fmt.Errorf("write NAT port set: %w", err)
		}
	}
	return d.updateConfig(func(c *Config) {
		c.PortMin, c.PortMax = lo, hi
		c.PortRanges, c.PortTotal = 0, 0
		if runs > 1 {
			c.PortRanges, c.PortTotal = runs, total
		}
	})
}

// NATPortsBlock is how many ports a value of nat_ports holds.
const NATPortsBlock = len(masqNatPortBlock{}.Port)

// NATPortBlock is a value of nat_ports: NATPortsBlock ports in order.
type NATPortBlock = masqNatPortBlock

// ConfigKeepPort is masq_config's MASQ_CFG_KEEP_PORT bit (enum masq_cfg_flag
// in lib/types.h).
const ConfigKeepPort = uint32(masqMasqCfgFlagMASQ_CFG_KEEP_PORT)

// ConfigRandomFully is masq_config's MASQ_CFG_RANDOM_FULLY bit.
const ConfigRandomFully = uint32(masqMasqCfgFlagMASQ_CFG_RANDOM_FULLY)

// Flags of a masq_src_v4/v6 value (enum masq_src_flag in lib/types.h): the
// longest source prefix's value alone decides, so the agent gives every
// entry the flags of all the prefixes that cover it.
const (
	// MasqSrcMasquerade: a masquerade source on every device the
	// datapath is attached to.
	MasqSrcMasquerade = uint8(masqMasqSrcFlagMASQ_SRC_MASQUERADE)
	// MasqSrcRules: a masquerade rule names the prefix (on some device):
	// masq_rules_v4/v6 are looked up first, and a rule found there wins.
	MasqSrcRules = uint8(masqMasqSrcFlagMASQ_SRC_RULES)
)

// SetKeepSourcePort sets whether a new TCP or UDP flow first tries its own
// source port (from 1024, outside the NAT range) before the range, as Linux
// MASQUERADE keeps it when the tuple is free.
func (d *Datapath) SetKeepSourcePort(keep bool) error {
	return d.updateConfig(func(c *Config) {
		c.Flags &^= ConfigKeepPort
		if keep {
			c.Flags |= ConfigKeepPort
		}
	})
}

// SetRandomFully sets whether a new TCP or UDP flow gets a random port of
// its space (MASQUERADE --random-fully) instead of trying its own first.
func (d *Datapath) SetRandomFully(random bool) error {
	return d.updateConfig(func(c *Config) {
		c.Flags &^= ConfigRandomFully
		if random {
			c.Flags |= ConfigRandomFully
		}
	})
}

// SetEgressDevice sets the SNAT addresses of a device; an invalid address
// leaves its family untranslated on that device.
func (d *Datapath) SetEgressDevice(ifindex int, v4, v6 netip.Addr) error {
	var dev EgressDev
	if v4.IsValid() {
		dev.SnatV4, dev.HasV4 = Addr4(v4), 1
	}
	if v6.IsValid() {
		dev.SnatV6, dev.HasV6 = v6.As16(), 1
	}
	if err := d.Maps.EgressDevs.Put(uint32(ifindex), dev); err != nil {
		return fmt.Errorf("set egress device %d: %w", ifindex, err)
	}
	return nil
}

// csumIPv6FlagSupported reports whether bpf_l4_csum_replace accepts
// BPF_F_IPV6 (Linux 6.16+), by running a tiny program that uses it.
func csumIPv6FlagSupported() bool {
	const (
		fPseudoHdr = 1 << 4
		fIPv6      = 1 << 7
	)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SchedCLS,
		Instructions: asm.Instructions{
			asm.Mov.Imm(asm.R2, 0),
			asm.Mov.Imm(asm.R3, 0),
			asm.Mov.Imm(asm.R4, 0),
			asm.Mov.Imm(asm.R5, fPseudoHdr|fIPv6),
			asm.FnL4CsumReplace.Call(),
			asm.Return(),
		},
		License: "GPL",
	})
	if err != nil {
		return false
	}
	defer prog.Close()
	ret, err := prog.Run(&ebpf.RunOptions{Data: make([]byte, 64)})
	return err == nil && ret == 0
}
