package e2e

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// metricsAddr is where the observability tests' agents serve /metrics.
const metricsAddr = "127.0.0.1:9464"

// scrape GETs path from an agent serving on metricsAddr in the node
// namespace. The connection is made on the thread inside the namespace
// (http.Get would dial from another goroutine).
func scrape(t *testing.T, node *topology.Netns, path string) (int, string) {
	t.Helper()
	var conn net.Conn
	err := node.Do(func() (err error) {
		conn, err = net.Dial("tcp", metricsAddr)
		return err
	})
	var (
		code int
		body []byte
	)
	if err == nil {
		defer conn.Close()
		fmt.Fprintf(conn, "GET %s HTTP/1.0\r\nHost: agent\r\n\r\n", path)
		var resp *http.Response
		if resp, err = http.ReadResponse(bufio.NewReader(conn), nil); err == nil {
			code = resp.StatusCode
			body, err = io.ReadAll(resp.Body)
		}
	}
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return code, string(body)
}

// metrics is one parsed scrape.
type metrics map[string]*dto.MetricFamily

func parseMetrics(t *testing.T, body string) metrics {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return mfs
}

// sum adds the values of name's series that carry the given labels.
func (m metrics) sum(name string, labels ...string) float64 {
	mf := m[name]
	if mf == nil {
		return -1
	}
	total := 0.0
series:
	for _, s := range mf.GetMetric() {
		have := map[string]string{}
		for _, l := range s.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if have[labels[i]] != labels[i+1] {
				continue series
			}
		}
		switch {
		case s.Counter != nil:
			total += s.GetCounter().GetValue()
		case s.Gauge != nil:
			total += s.GetGauge().GetValue()
		}
	}
	return total
}

// natCapacity is TestDatapathCountersAndDrops' --nat-max-entries: the
// metric shows the configured size (the default is the node's).
const natCapacity = 131072

// TestDatapathCountersAndDrops: real traffic through the node shows under
// ipmasq_packets_total by device, family, direction and action, and one
// packet of each drop reason this topology can provoke shows under its
// reason and device in ipmasq_drops_total (and as a dropped packet); the
// nat command lists the flows that were opened and not the refused one.
func TestDatapathCountersAndDrops(t *testing.T) {
	// One NAT port: a second flow to the same destination finds none.
	topo, a, ext := setup(t, masqueradeAll, "--prometheus-serve-addr="+metricsAddr,
		"--nat-port-range=61000-61000", "--nat-keep-source-port=false",
		fmt.Sprintf("--nat-max-entries=%d", natCapacity))
	get := func() metrics { _, body := scrape(t, topo.Node, "/metrics"); return parseMetrics(t, body) }
	eth0 := func(labels ...string) []string { return append([]string{"device", "eth0"}, labels...) }

	checkSource(t, topo, ext, topology.RemoteIP4, topology.NodeIP4, 1)
	checkSource(t, topo, ext, topology.RemoteIP6, topology.NodeIP6, 1)
	m := get()
	for _, c := range []struct {
		family, dir string
		min         float64
	}{
		// TCP (at least SYN, ACK, data, FIN), a UDP datagram, an echo request.
		{"ipv4", "egress", 4}, {"ipv4", "ingress", 4}, {"ipv6", "egress", 4}, {"ipv6", "ingress", 4},
	} {
		if got := m.sum("ipmasq_packets_total", eth0("family", c.family, "direction", c.dir, "action", "translated")...); got < c.min {
			t.Errorf("%s %s translated on eth0: %v, want at least %v", c.family, c.dir, got, c.min)
		}
	}
	if got := m.sum("ipmasq_packets_total", eth0("action", "dropped")...); got != 0 {
		t.Fatalf("dropped before any drop was provoked: %v", got)
	}
	// The programs also see what they leave alone (the agent's own
	// neighbour discovery, ARP): passed.
	if got := m.sum("ipmasq_packets_total", eth0("action", "passed")...); got <= 0 {
		t.Errorf("passed on eth0: %v, want some", got)
	}

	pods := podAddresses(t, topo.Pod, 2)
	drops := []struct {
		reason string
		send   func() error
	}{
		{"no-free-port", func() error {
			// udpSource's flow holds 61000 toward RemoteIP4:udpPort; a
			// flow from another port needs a second one.
			return sendFrom(topo.Pod, "udp", netip.AddrPort{}, netip.AddrPortFrom(topology.RemoteIP4, udpPort), []byte("refused"))
		}},
		{"untranslatable", func() error {
			// An echo reply the pod sends for no flow anyone opened.
			return sendRaw(topo.Pod, "ip4:icmp", netip.Addr{}, topology.RemoteIP4, []byte{0, 0, 0, 0, 0x43, 0x21, 0, 1})
		}},
		{"icmp-error-unmatched", func() error {
			// Port unreachable about a datagram RemoteIP4 never sent.
			quote := ipv4UDPHeader(topology.RemoteIP4, topology.PodIP4, 5555, 6666)
			return sendRaw(topo.Pod, "ip4:icmp", netip.Addr{}, topology.RemoteIP4, append([]byte{3, 3, 0, 0, 0, 0, 0, 0}, quote...))
		}},
		{"error", func() error {
			// A TCP segment cut to 4 bytes: no header to translate.
			return sendRaw(topo.Pod, "ip4:tcp", netip.Addr{}, topology.RemoteIP4, []byte{0x9c, 0x40, 0x1b, 0x58})
		}},
		{"pair-taken", func() error {
			// Two pods, one SCTP port toward one remote: SCTP keeps the
			// port, so the second cannot have it.
			for _, pod := range pods {
				if err := sendRaw(topo.Pod, fmt.Sprintf("ip4:%d", protoSCTP), pod, topology.RemoteIP4, payloadFor(protoSCTP, 40123, 38412)); err != nil {
					return err
				}
			}
			return nil
		}},
	}
	dropped := 0.0
	for _, d := range drops {
		before := get()
		if err := d.send(); err != nil {
			t.Fatalf("%s: send: %v", d.reason, err)
		}
		want := before.sum("ipmasq_drops_total", eth0("family", "ipv4", "reason", d.reason)...) + 1
		var after metrics
		a.waitFor("a drop with reason "+d.reason, func() bool {
			after = get()
			return after.sum("ipmasq_drops_total", eth0("family", "ipv4", "reason", d.reason)...) >= want
		})
		dropped++
		if got := after.sum("ipmasq_drops_total", eth0("family", "ipv4", "reason", d.reason)...); got != want {
			t.Errorf("%s: drops %v, want %v", d.reason, got, want)
		}
		if got := after.sum("ipmasq_drops_total", eth0()...); got != dropped {
			t.Errorf("after %s: %v drops on eth0, want %v (one per provoked packet)", d.reason, got, dropped)
		}
		if got := after.sum("ipmasq_packets_total", eth0("family", "ipv4", "direction", "egress", "action", "dropped")...); got != dropped {
			t.Errorf("after %s: %v egress packets dropped on eth0, want %v", d.reason, got, dropped)
		}
	}
	m = get()
	if got := m.sum("ipmasq_nat_port_search_failures_total", "family", "ipv4"); got != 1 {
		t.Errorf("port search failures: %v, want 1", got)
	}
	if got := m.sum("ipmasq_nat_capacity", "family", "ipv4"); got != natCapacity {
		t.Errorf("NAT capacity of ipv4: %v, want %v (--nat-max-entries)", got, natCapacity)
	}
	// TCP (closing), UDP (answered), echo, per family, and the SCTP pair
	// of ipv4: the datapath's counts, read at the scrape.
	for _, c := range []struct {
		family, kind string
		want         float64
	}{
		{"ipv4", "masquerade", 4}, {"ipv6", "masquerade", 3}, {"ipv4", "inbound", 0}, {"ipv4", "host", 0},
	} {
		if got := m.sum("ipmasq_nat_pairs", "family", c.family, "kind", c.kind); got != c.want {
			t.Errorf("NAT pairs %s %s: %v, want %v; the pairs:\n%s", c.family, c.kind, got, c.want, natCommand(t, a))
		}
	}

	// The nat command lists the flows: the pod's, translated to the node's
	// address and the one NAT port; not the refused second UDP flow.
	nat := natCommand(t, a, "--src", "10.244.1.0/24", "--dst", topology.RemoteIP4.String())
	for _, want := range []string{
		`^masquerade ipv4 tcp tcp-closing age=\d+s expires=\S+ 10\.244\.1\.2:\d+ -> 203\.0\.113\.10:7000 as 10\.0\.0\.5:61000$`,
		`^masquerade ipv4 udp udp age=\d+s expires=\S+ 10\.244\.1\.2:\d+ -> 203\.0\.113\.10:7001 as 10\.0\.0\.5:61000$`,
		`^masquerade ipv4 icmp icmp age=\d+s expires=\S+ 10\.244\.1\.2:\d+ -> 203\.0\.113\.10:0 as 10\.0\.0\.5:61000$`,
		`^masquerade ipv4 sctp other age=\d+s expires=\S+ 10\.244\.1\.10:40123 -> 203\.0\.113\.10:38412 as 10\.0\.0\.5:40123$`,
	} {
		if !regexp.MustCompile(`(?m)` + want).MatchString(nat) {
			t.Errorf("nat lacks %s:\n%s", want, nat)
		}
	}
	if n := strings.Count(nat, "\n"); n != 4 {
		t.Errorf("nat lists %d pairs from the pods to %s, want 4:\n%s", n, topology.RemoteIP4, nat)
	}
	if got := natCommand(t, a, "--count", "--proto", "udp", "--dst", topology.RemoteIP4.String()); got != "1\n" {
		t.Errorf("nat --count --proto udp: %q, want 1 (the refused flow has no pair)", got)
	}
	var pairs []struct {
		Proto      string
		State      string
		Original   struct{ Src, Dst netip.AddrPort }
		Translated *struct{ Src, Dst netip.AddrPort }
	}
	if err := json.Unmarshal([]byte(natCommand(t, a, "-o", "json", "--proto", "tcp", "--src", topology.PodIP6.String())), &pairs); err != nil {
		t.Fatal(err)
	}
	if len(pairs) != 1 || pairs[0].Translated == nil || pairs[0].Translated.Src.Addr() != topology.NodeIP6 ||
		pairs[0].Original.Dst != netip.AddrPortFrom(topology.RemoteIP6, tcpPort) || pairs[0].State != "tcp-closing" {
		t.Errorf("nat -o json --proto tcp --src %s: %+v", topology.PodIP6, pairs)
	}
}

// natCommand runs "ipmasq-agent nat" on the agent's pins.
func natCommand(t *testing.T, a *agent, args ...string) string {
	t.Helper()
	out, err := exec.Command(agentBin, append([]string{"nat", "--bpf-root=" + a.bpfRoot}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("ipmasq-agent nat %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// sendFrom sends one datagram from a new socket in n (bound to from when
// valid) to dst.
func sendFrom(n *topology.Netns, network string, from, dst netip.AddrPort, payload []byte) error {
	var c net.Conn
	err := n.Do(func() (err error) {
		d := net.Dialer{}
		if from.IsValid() {
			d.LocalAddr = net.UDPAddrFromAddrPort(from)
		}
		c, err = d.Dial(network, dst.String())
		return err
	})
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.Write(payload)
	return err
}

// sendRaw sends payload over a raw IP socket of network ("ip4:icmp",
// "ip4:132", ...) in n, from src when valid.
func sendRaw(n *topology.Netns, network string, src, dst netip.Addr, payload []byte) error {
	laddr := "0.0.0.0"
	if src.IsValid() {
		laddr = src.String()
	}
	var c net.PacketConn
	if err := n.Do(func() (err error) { c, err = net.ListenPacket(network, laddr); return err }); err != nil {
		return err
	}
	defer c.Close()
	if network == "ip4:icmp" {
		binary.BigEndian.PutUint16(payload[2:], 0)
		binary.BigEndian.PutUint16(payload[2:], icmpChecksum(payload))
	}
	_, err := c.WriteTo(payload, &net.IPAddr{IP: dst.AsSlice()})
	return err
}

// ipv4UDPHeader is the IPv4 and UDP header of a datagram src:sport →
// dst:dport, as an ICMP error quotes it.
func ipv4UDPHeader(src, dst netip.Addr, sport, dport uint16) []byte {
	h := make([]byte, 28)
	h[0], h[8], h[9] = 0x45, 64, 17
	binary.BigEndian.PutUint16(h[2:], 28+8)
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	binary.BigEndian.PutUint16(h[10:], icmpChecksum(h[:20]))
	binary.BigEndian.PutUint16(h[20:], sport)
	binary.BigEndian.PutUint16(h[22:], dport)
	binary.BigEndian.PutUint16(h[24:], 8+8)
	return h
}

// conntrackTuple is what the nat listing and conntrack -L agree on for a
// flow: protocol, original source address, destination, the address it is
// translated to, and the state in ipmasq's names.
type conntrackTuple struct {
	proto, src, dst, translated, state string
}

// TestNATListingLikeConntrack: the flows a pod opens are listed by
// conntrack -L under Linux MASQUERADE and by ipmasq-agent nat under
// ipmasq with the same protocol, original tuple, translated source and
// state.
func TestNATListingLikeConntrack(t *testing.T) {
	var reference []conntrackTuple
	underBoth(t, masqueradePods(), func(t *testing.T, s *scenario) {
		checkSource(t, s.topo, s.ext, topology.RemoteIP4, topology.NodeIP4, 1)
		var got []conntrackTuple
		if s.agent == nil {
			got = conntrackFlows(t, s.topo.Node)
			reference = got
		} else {
			got = natFlows(t, s.agent)
		}
		slices.SortFunc(got, func(a, b conntrackTuple) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) })
		want := []conntrackTuple{
			{"icmp", "10.244.1.2", "203.0.113.10", "10.0.0.5", "icmp"},
			{"tcp", "10.244.1.2", "203.0.113.10:7000", "10.0.0.5", "tcp-closing"},
			{"udp", "10.244.1.2", "203.0.113.10:7001", "10.0.0.5", "udp"},
		}
		if !slices.Equal(got, want) {
			t.Fatalf("flows listed: %v, want %v (reference: %v)", got, want, reference)
		}
	})
}

// conntrackFlows lists the pod's flows with conntrack -L in the node.
func conntrackFlows(t *testing.T, node *topology.Netns) []conntrackTuple {
	t.Helper()
	bin, err := exec.LookPath("conntrack")
	if err != nil {
		t.Fatalf("conntrack (Debian package conntrack) lists the reference's flows: %v", err)
	}
	cmd := exec.Command(bin, "-L", "-s", topology.PodIP4.String())
	var out []byte
	if err := node.Do(func() (err error) { out, err = cmd.Output(); return err }); err != nil {
		t.Fatalf("conntrack -L: %v\n%s", err, out)
	}
	var flows []conntrackTuple
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		kv := map[string][]string{}
		for _, w := range f {
			if k, v, ok := strings.Cut(w, "="); ok {
				kv[k] = append(kv[k], v)
			}
		}
		if len(kv["src"]) < 2 || len(kv["dst"]) < 2 {
			continue
		}
		c := conntrackTuple{proto: f[0], src: kv["src"][0], dst: kv["dst"][0], translated: kv["dst"][1]}
		if len(kv["dport"]) > 0 {
			c.dst += ":" + kv["dport"][0]
		}
		switch c.proto {
		case "tcp":
			c.state = map[string]string{"SYN_SENT": "tcp-syn", "ESTABLISHED": "tcp-established", "CLOSE": "tcp-reset"}[f[3]]
			if c.state == "" {
				c.state = "tcp-closing" // FIN_WAIT, CLOSE_WAIT, LAST_ACK, TIME_WAIT
			}
		case "udp":
			// A query, answered or not, is ipmasq's "udp"; conntrack
			// assures a stream (active 2 s after it started).
			c.state = "udp"
			if strings.Contains(line, "[ASSURED]") {
				c.state = "udp-stream"
			}
		case "icmp":
			c.state = "icmp"
		}
		flows = append(flows, c)
	}
	return flows
}

// natFlows lists the pod's flows with ipmasq-agent nat -o json.
func natFlows(t *testing.T, a *agent) []conntrackTuple {
	t.Helper()
	var pairs []struct {
		Proto, State string
		Original     struct{ Src, Dst netip.AddrPort }
		Translated   *struct{ Src netip.AddrPort }
	}
	if err := json.Unmarshal([]byte(natCommand(t, a, "-o", "json", "--src", topology.PodIP4.String())), &pairs); err != nil {
		t.Fatal(err)
	}
	var flows []conntrackTuple
	for _, p := range pairs {
		c := conntrackTuple{proto: p.Proto, src: p.Original.Src.Addr().String(), dst: p.Original.Dst.String(), state: p.State}
		if p.Proto == "icmp" {
			c.dst = p.Original.Dst.Addr().String()
		}
		if p.Translated != nil {
			c.translated = p.Translated.Src.Addr().String()
		}
		flows = append(flows, c)
	}
	return flows
}

// TestQuietSteadyState: once started, an agent whose config and devices do
// not change writes nothing at INFO, however many resyncs (config re-read,
// map drift repair) run.
func TestQuietSteadyState(t *testing.T) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	a := newAgent(t, topo.Node, masqueradeAll+"resyncInterval: 200ms\n")
	a.args = []string{"--log-level=info"} // after the harness's --log-level=debug: the last wins
	a.start()
	var started int
	a.waitFor("the hive started", func() bool {
		data, _ := os.ReadFile(a.log)
		started = strings.Index(string(data), `msg="Started hive"`)
		return started >= 0
	})
	time.Sleep(2 * time.Second) // ten resyncs
	data, err := os.ReadFile(a.log)
	if err != nil {
		t.Fatal(err)
	}
	steady := string(data[started:])
	_, steady, _ = strings.Cut(steady, "\n")
	// The device watcher reports the selected devices once after start,
	// and readiness its way to the first Ready (the programs attach just
	// after the hive's start); anything after that is noise.
	var noisy []string
	ready := false
	for line := range strings.Lines(steady) {
		switch {
		case !strings.Contains(line, "level=INFO"), strings.Contains(line, `msg="Egress devices selected"`):
		case !ready && strings.Contains(line, "module=readiness") && strings.Contains(line, `msg="Not ready"`):
		case !ready && strings.Contains(line, "module=readiness") && strings.Contains(line, "msg=Ready"):
			ready = true
		default:
			noisy = append(noisy, line)
		}
	}
	if len(noisy) > 0 {
		t.Errorf("INFO lines at steady state (2 s, resyncInterval 200ms):\n%s", strings.Join(noisy, ""))
	}
	if !strings.Contains(string(data), `msg="Config applied"`) {
		t.Errorf("the first load was not logged at INFO:\n%s", data)
	}
}
