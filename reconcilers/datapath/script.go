package datapath

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/tables"
)

// scriptCommands are the shell and script-test commands of the datapath:
//
//	datapath/counters  the datapath's counters, summed over CPUs
//	datapath/nat       the NAT pairs, one line per direction
//	datapath/gc        expire idle NAT pairs now
func scriptCommands(l *Handle, db *statedb.DB, cfg Config, nodeAddrs statedb.Table[*tables.NodeAddress],
	srcs statedb.Table[*tables.MasqueradeRuleSource]) hive.ScriptCmdsOut {
	// Bad lifetimes stop the agent in register; these are never used then.
	lifetimes, _ := cfg.Lifetimes()
	return hive.NewScriptCmds(map[string]script.Cmd{
		"datapath/counters": script.Command(
			script.CmdUsage{Summary: "Show the datapath counters (summed over CPUs)"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				dp := l.get()
				if dp == nil {
					return nil, ErrNotLoaded
				}
				out, err := FormatCounters(dp)
				return func(*script.State) (string, string, error) { return out, "", err }, nil
			}),
		"datapath/nat": script.Command(
			script.CmdUsage{Summary: "List the NAT entries: proto, direction, tuple and translation"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				dp := l.get()
				if dp == nil {
					return nil, ErrNotLoaded
				}
				out, err := FormatNAT(dp)
				return func(*script.State) (string, string, error) { return out, "", err }, nil
			}),
		"datapath/gc": script.Command(
			script.CmdUsage{Summary: "Expire idle NAT entries now"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				c := &collector{dp: l, lifetimes: lifetimes, snat: func() (map[netip.Addr]bool, bool) {
					return liveSNATAddrs(db, nodeAddrs, srcs)
				}}
				return nil, c.collectNow()
			}),
	})
}

// FormatCounters prints "name value" lines for every counter.
func FormatCounters(dp *bpf.Datapath) (string, error) {
	vals, err := bpf.ReadCounters(dp.Maps.Counters)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for i, v := range vals {
		fmt.Fprintf(&b, "%s %d\n", bpf.Counter(i), v)
	}
	return b.String(), nil
}

// FormatNAT prints one line per NAT entry, sorted.
func FormatNAT(dp *bpf.Datapath) (string, error) {
	var lines []string
	var k4 bpf.NATKeyV4
	var v4 bpf.NATValV4
	it := dp.Maps.NatV4.Iterate()
	for it.Next(&k4, &v4) {
		lines = append(lines, natLine(k4.Proto, k4.Dir,
			netip.AddrPortFrom(bpf.AddrFrom4(k4.Src), bpf.HostPort(k4.Sport)),
			netip.AddrPortFrom(bpf.AddrFrom4(k4.Dst), bpf.HostPort(k4.Dport)),
			netip.AddrPortFrom(bpf.AddrFrom4(v4.Addr), bpf.HostPort(v4.Port))))
	}
	if err := it.Err(); err != nil {
		return "", err
	}
	var k6 bpf.NATKeyV6
	var v6 bpf.NATValV6
	it = dp.Maps.NatV6.Iterate()
	for it.Next(&k6, &v6) {
		lines = append(lines, natLine(k6.Proto, k6.Dir,
			netip.AddrPortFrom(netip.AddrFrom16(k6.Src), bpf.HostPort(k6.Sport)),
			netip.AddrPortFrom(netip.AddrFrom16(k6.Dst), bpf.HostPort(k6.Dport)),
			netip.AddrPortFrom(netip.AddrFrom16(v6.Addr), bpf.HostPort(v6.Port))))
	}
	if err := it.Err(); err != nil {
		return "", err
	}
	slices.Sort(lines)
	return strings.Join(lines, ""), nil
}

func natLine(proto, dir uint8, src, dst, to netip.AddrPort) string {
	name, ok := map[uint8]string{protoTCP: "tcp", protoUDP: "udp", protoICMP: "icmp", protoICMPv6: "icmpv6", protoSCTP: "sctp"}[proto]
	if !ok {
		name = fmt.Sprintf("proto-%d", proto) // address-only: GRE 47, ESP 50, ...
	}
	if dir == bpf.DirEgress {
		return fmt.Sprintf("%s egress %s -> %s: source becomes %s\n", name, src, dst, to)
	}
	return fmt.Sprintf("%s ingress %s -> %s: destination becomes %s\n", name, src, dst, to)
}
