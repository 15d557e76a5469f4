package nodee2e

import (
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// extNames are the external resolver's names (A records); every other
// name does not exist.
var extNames = map[string]string{
	"masq.example.test.":  masqTarget,
	"plain.example.test.": plainTarget,
}

// extResolver is the DNS server outside the cluster that CoreDNS forwards
// to (the node's resolv.conf names it): it answers extNames and records
// the source address of every query, by name.
type extResolver struct {
	mu   sync.Mutex
	from map[string]map[netip.Addr]int
}

// serveResolver runs the resolver on addr:53 (UDP) in ns until the test
// ends.
func serveResolver(t *testing.T, ns *topology.Netns, addr netip.Addr) (*extResolver, error) {
	var c *net.UDPConn
	if err := ns.Do(func() (err error) {
		c, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(addr, 53)))
		return err
	}); err != nil {
		return nil, err
	}
	t.Cleanup(func() { c.Close() })
	r := &extResolver{from: map[string]map[netip.Addr]int{}}
	go func() {
		buf := make([]byte, 1500)
		for {
			m, src, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			if ans := r.answer(buf[:m], src.Addr().Unmap()); ans != nil {
				c.WriteToUDPAddrPort(ans, src)
			}
		}
	}()
	return r, nil
}

// answer builds the response to one query (nil for garbage).
func (r *extResolver) answer(query []byte, from netip.Addr) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil {
		return nil
	}
	q, err := p.Question()
	if err != nil {
		return nil
	}
	name := strings.ToLower(q.Name.String())
	r.mu.Lock()
	if r.from[name] == nil {
		r.from[name] = map[netip.Addr]int{}
	}
	r.from[name][from]++
	r.mu.Unlock()

	resp := dnsmessage.Message{
		Header:    dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired, RecursionAvailable: true},
		Questions: []dnsmessage.Question{q},
	}
	ip, known := extNames[name]
	switch {
	case !known:
		resp.RCode = dnsmessage.RCodeNameError
	case q.Type == dnsmessage.TypeA:
		a := netip.MustParseAddr(ip).As4()
		resp.Answers = []dnsmessage.Resource{{
			Header: dnsmessage.ResourceHeader{Name: q.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 5},
			Body:   &dnsmessage.AResource{A: a},
		}}
	}
	out, err := resp.Pack()
	if err != nil {
		return nil
	}
	return out
}

// sources are the addresses queries for name came from.
func (r *extResolver) sources(name string) map[netip.Addr]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[netip.Addr]int{}
	for a, n := range r.from[name] {
		out[a] = n
	}
	return out
}
