package natview

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ipmasq/ipmasq/bpf"
)

// Source is what the listing reads; bpf.Pinned is one.
type Source interface {
	NATPairs(visit func(*bpf.NATPair) bool) error
	Lifetimes() (bpf.Lifetimes, error)
	NATFill() ([]bpf.NATMapFill, error)
	// NATCounts are the programs' counts of the pairs by family and kind
	// (bpf.Pinned.NATCounts): what --count reads when no flag but
	// --kind narrows it.
	NATCounts() ([]bpf.NATCounts, error)
}

var _ Source = bpf.Pinned{}

// Write lists the pairs of src that match o on w, in the format o asks for.
// Bad options are an error naming the flag, before anything is read.
func Write(w io.Writer, src Source, o Options) error {
	f, err := o.compile()
	if err != nil {
		return err
	}
	if o.Count && f.byKindOnly() {
		// conntrack -C: the count the datapath keeps, the same cost at
		// any size.
		counts, err := src.NATCounts()
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%d\n", f.countOf(counts))
		return err
	}
	lifetimes, err := src.Lifetimes()
	if err != nil {
		return err
	}
	now := bpf.KtimeNow()
	bw := bufio.NewWriterSize(w, 64<<10)
	switch {
	case o.Count:
		n := 0
		err = src.NATPairs(func(p *bpf.NATPair) bool {
			if f.match(p) {
				n++
			}
			return true
		})
		if err == nil {
			fmt.Fprintf(bw, "%d\n", n)
		}
	case o.Summary:
		err = writeSummary(bw, src, f, o.Output == "json")
	case o.Output == "json":
		err = writeJSON(bw, src, f, lifetimes, now)
	default:
		var line []byte
		err = src.NATPairs(func(p *bpf.NATPair) bool {
			if f.match(p) {
				line = appendText(line[:0], p, lifetimes, now)
				_, werr := bw.Write(line)
				return werr == nil
			}
			return true
		})
	}
	if ferr := bw.Flush(); err == nil {
		err = ferr
	}
	return err
}

func family(p *bpf.NATPair) string {
	if p.IPv6 {
		return "ipv6"
	}
	return "ipv4"
}

// appendText is one line:
//
//	masquerade ipv4 tcp tcp-established age=12s expires=119h59m48s 10.244.1.2:53620 -> 198.51.100.7:8080 as 10.0.0.5:53620
func appendText(b []byte, p *bpf.NATPair, l bpf.Lifetimes, now uint64) []byte {
	b = append(b, p.Kind.String()...)
	b = append(b, ' ')
	b = append(b, family(p)...)
	b = append(b, ' ')
	b = append(b, bpf.ProtoName(p.Proto)...)
	b = append(b, ' ')
	b = append(b, p.State.String()...)
	b = append(b, " age="...)
	b = appendSeconds(b, p.Age(now))
	b = append(b, " expires="...)
	if left := p.ExpiresIn(l, now); left > 0 {
		b = appendSeconds(b, left)
	} else {
		b = append(b, "expired"...)
	}
	b = append(b, ' ')
	b = p.Src.AppendTo(b)
	b = append(b, " -> "...)
	b = p.Dst.AppendTo(b)
	if p.Translated.IsValid() {
		b = append(b, " as "...)
		b = p.Translated.AppendTo(b)
	}
	if p.ReplyMissing {
		b = append(b, " reply-entry-evicted"...)
	}
	return append(b, '\n')
}

// appendSeconds writes d rounded down to the second, as time.Duration
// prints it (5h59m48s).
func appendSeconds(b []byte, d time.Duration) []byte {
	d = d.Truncate(time.Second)
	if d < time.Minute {
		b = strconv.AppendInt(b, int64(d/time.Second), 10)
		return append(b, 's')
	}
	return append(b, d.String()...)
}

// jsonTuple is a tuple of a JSON record.
type jsonTuple struct {
	Src netip.AddrPort `json:"src"`
	Dst netip.AddrPort `json:"dst"`
}

// jsonPair is one pair of -o json. Packets and bytes are absent: the NAT
// entries do not count them.
type jsonPair struct {
	Kind       string     `json:"kind"`
	Family     string     `json:"family"`
	Proto      string     `json:"proto"`
	State      string     `json:"state"`
	Original   jsonTuple  `json:"original"`
	Translated *jsonTuple `json:"translated,omitempty"`
	AgeSeconds float64    `json:"ageSeconds"`
	// ExpiresInSeconds is how long the pair lives without a packet;
	// zero or less: expired, waiting for the collector.
	ExpiresInSeconds float64  `json:"expiresInSeconds"`
	Flags            []string `json:"flags,omitempty"`
}

// writeJSON writes an array with one pair a line.
func writeJSON(w *bufio.Writer, src Source, f filter, l bpf.Lifetimes, now uint64) error {
	w.WriteString("[")
	sep := "\n"
	var (
		buf  []byte
		werr error
	)
	err := src.NATPairs(func(p *bpf.NATPair) bool {
		if !f.match(p) {
			return true
		}
		rec := jsonPair{
			Kind: p.Kind.String(), Family: family(p), Proto: bpf.ProtoName(p.Proto), State: p.State.String(),
			Original:         jsonTuple{p.Src, p.Dst},
			AgeSeconds:       p.Age(now).Seconds(),
			ExpiresInSeconds: p.ExpiresIn(l, now).Seconds(),
			Flags:            flagNames(p),
		}
		if p.Translated.IsValid() {
			rec.Translated = &jsonTuple{p.Translated, p.Dst}
		}
		if buf, werr = json.Marshal(&rec); werr != nil {
			return false
		}
		w.WriteString(sep)
		w.Write(buf)
		sep = ",\n"
		return true
	})
	if err == nil {
		err = werr
	}
	if sep == "\n" {
		w.WriteString("]\n") // no pair: []
	} else {
		w.WriteString("\n]\n")
	}
	return err
}

func flagNames(p *bpf.NATPair) []string {
	var out []string
	for _, f := range []struct {
		bit  uint8
		name string
	}{{bpf.NATFlagSeen, "answered"}, {bpf.NATFlagFIN, "fin"}, {bpf.NATFlagRST, "rst"}} {
		if p.Flags&f.bit != 0 {
			out = append(out, f.name)
		}
	}
	if p.ReplyMissing {
		out = append(out, "reply-entry-evicted")
	}
	return out
}

// summaryKey groups pairs in the summary.
type summaryKey struct {
	kind   bpf.NATKind
	family string
	proto  uint8
	state  bpf.NATState
}

func writeSummary(w *bufio.Writer, src Source, f filter, asJSON bool) error {
	fill, err := src.NATFill()
	if err != nil {
		return err
	}
	counts := map[summaryKey]int{}
	total := 0
	err = src.NATPairs(func(p *bpf.NATPair) bool {
		if f.match(p) {
			counts[summaryKey{p.Kind, family(p), p.Proto, p.State}]++
			total++
		}
		return true
	})
	if err != nil {
		return err
	}
	keys := make([]summaryKey, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b summaryKey) int {
		if c := int(a.kind) - int(b.kind); c != 0 {
			return c
		}
		if c := strings.Compare(a.family, b.family); c != 0 {
			return c
		}
		if c := int(a.proto) - int(b.proto); c != 0 {
			return c
		}
		return int(a.state) - int(b.state)
	})
	if asJSON {
		type group struct {
			Kind   string `json:"kind"`
			Family string `json:"family"`
			Proto  string `json:"proto"`
			State  string `json:"state"`
			Pairs  int    `json:"pairs"`
		}
		out := struct {
			Maps   []bpf.NATMapFill `json:"maps"`
			Pairs  int              `json:"pairs"`
			Groups []group          `json:"groups"`
		}{Maps: fill, Pairs: total, Groups: []group{}}
		for _, k := range keys {
			out.Groups = append(out.Groups, group{k.kind.String(), k.family, bpf.ProtoName(k.proto), k.state.String(), counts[k]})
		}
		return json.NewEncoder(w).Encode(out)
	}
	fmt.Fprintf(w, "%-6s %9s %9s %6s\n", "MAP", "ENTRIES", "CAPACITY", "FILL")
	for _, m := range fill {
		fmt.Fprintf(w, "%-6s %9d %9d %5.1f%%\n", m.Family, m.Entries, m.Capacity, 100*float64(m.Entries)/float64(max(m.Capacity, 1)))
	}
	fmt.Fprintf(w, "\n%-10s %-6s %-8s %-16s %9s\n", "KIND", "FAMILY", "PROTO", "STATE", "PAIRS")
	for _, k := range keys {
		fmt.Fprintf(w, "%-10s %-6s %-8s %-16s %9d\n", k.kind, k.family, bpf.ProtoName(k.proto), k.state, counts[k])
	}
	fmt.Fprintf(w, "%-10s %-6s %-8s %-16s %9d\n", "total", "", "", "", total)
	return nil
}
