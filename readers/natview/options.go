package natview

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/bpf"
)

// Options are the nat command's flags.
type Options struct {
	Src, Dst string
	Port     uint16
	Proto    string
	State    string
	Kind     string
	Output   string
	Summary  bool
	Count    bool
}

// AddFlags registers the options on fs (the CLI's and the shell command's).
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.Src, "src", "", "only pairs whose original source is this address or inside this prefix")
	fs.StringVar(&o.Dst, "dst", "", "only pairs whose original destination is this address or inside this prefix")
	fs.Uint16Var(&o.Port, "port", 0, "only pairs with this port on either side, original or translated")
	fs.StringVar(&o.Proto, "proto", "", "only this protocol: tcp, udp, icmp, icmpv6, sctp or a number")
	fs.StringVar(&o.State, "state", "", "only this state: "+strings.Join(stateNames(), ", "))
	fs.StringVar(&o.Kind, "kind", "", "only this kind: masquerade (translated flows), inbound (opened by a remote), host (a node socket's hold on a NAT port)")
	fs.StringVarP(&o.Output, "output", "o", "text", "text (one pair a line) or json")
	fs.BoolVarP(&o.Summary, "summary", "S", false, "map fill per family and the pairs by kind, protocol and state, like conntrack -S")
	fs.BoolVarP(&o.Count, "count", "C", false, "only the number of pairs (that match), like conntrack -C")
}

func stateNames() []string {
	var out []string
	for _, s := range bpf.NATStates() {
		out = append(out, s.String())
	}
	return out
}

// filter is Options, parsed.
type filter struct {
	src, dst netip.Prefix
	port     uint16
	proto    int // -1: any
	state    int // -1: any
	kind     int // -1: any
}

// compile checks the options and returns the filter they describe; an
// error names the flag and what would be accepted.
func (o *Options) compile() (filter, error) {
	f := filter{proto: -1, state: -1, kind: -1, port: o.Port}
	var err error
	if f.src, err = parsePrefix("--src", o.Src); err != nil {
		return f, err
	}
	if f.dst, err = parsePrefix("--dst", o.Dst); err != nil {
		return f, err
	}
	if o.Proto != "" {
		if f.proto, err = parseProto(o.Proto); err != nil {
			return f, err
		}
	}
	if o.State != "" {
		names := stateNames()
		f.state = -1
		for i, n := range names {
			if n == o.State {
				f.state = i
			}
		}
		if f.state < 0 {
			return f, fmt.Errorf("--state=%q: want one of %s", o.State, strings.Join(names, ", "))
		}
	}
	if o.Kind != "" {
		for k := bpf.KindMasquerade; k <= bpf.KindHost; k++ {
			if k.String() == o.Kind {
				f.kind = int(k)
			}
		}
		if f.kind < 0 {
			return f, fmt.Errorf("--kind=%q: want masquerade, inbound or host", o.Kind)
		}
	}
	if o.Output != "text" && o.Output != "json" {
		return f, fmt.Errorf("--output=%q: want text or json", o.Output)
	}
	if o.Summary && o.Count {
		return f, fmt.Errorf("--summary and --count: choose one")
	}
	return f, nil
}

func parsePrefix(flag, s string) (netip.Prefix, error) {
	if s == "" {
		return netip.Prefix{}, nil
	}
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return p, fmt.Errorf("%s=%q: want an address or a prefix (10.244.1.2, 10.244.0.0/16, 2001:db8::/32)", flag, s)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%s=%q: want an address or a prefix (10.244.1.2, 10.244.0.0/16, 2001:db8::/32)", flag, s)
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

var protoNumbers = map[string]int{"tcp": bpf.ProtoTCP, "udp": bpf.ProtoUDP, "icmp": bpf.ProtoICMP,
	"icmpv6": bpf.ProtoICMPv6, "sctp": bpf.ProtoSCTP}

func parseProto(s string) (int, error) {
	if n, ok := protoNumbers[strings.ToLower(s)]; ok {
		return n, nil
	}
	n, err := strconv.ParseUint(s, 10, 8)
	if err != nil {
		return 0, fmt.Errorf("--proto=%q: want tcp, udp, icmp, icmpv6, sctp or an IP protocol number (0-255)", s)
	}
	return int(n), nil
}

// byKindOnly says whether nothing but the kind narrows the pairs: then the
// programs' counts answer a count, without reading the pairs.
func (f *filter) byKindOnly() bool {
	return f.proto < 0 && f.state < 0 && f.port == 0 && !f.src.IsValid() && !f.dst.IsValid()
}

// countOf is the number of pairs of f's kind (every kind: -1) in counts.
func (f *filter) countOf(counts []bpf.NATCounts) int {
	n := 0
	for _, c := range counts {
		if f.kind < 0 {
			n += c.Pairs()
		} else {
			n += c.Of(bpf.NATKind(f.kind))
		}
	}
	return n
}

func (f *filter) match(p *bpf.NATPair) bool {
	if f.proto >= 0 && int(p.Proto) != f.proto ||
		f.state >= 0 && int(p.State) != f.state ||
		f.kind >= 0 && int(p.Kind) != f.kind {
		return false
	}
	if f.src.IsValid() && !f.src.Contains(p.Src.Addr()) || f.dst.IsValid() && !f.dst.Contains(p.Dst.Addr()) {
		return false
	}
	if f.port != 0 && p.Src.Port() != f.port && p.Dst.Port() != f.port &&
		!(p.Translated.IsValid() && p.Translated.Port() == f.port) {
		return false
	}
	return true
}
