package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
)

// chaosSeed makes the kill points of TestRestartChaos reproducible: change
// it to explore other schedules, keep a failing one to replay it.
const chaosSeed = 20240611

// chaosConfig is one of the configs TestRestartChaos alternates between:
// no-masquerade ranges that never cover ext's addresses, so every flow of
// the test must leave masqueraded whichever config is (being) applied.
type chaosConfig struct {
	cidrs []string
}

func (c chaosConfig) file() string {
	return fmt.Sprintf("nonMasqueradeCIDRs: [%s]\nmasqLinkLocal: true\nmasqLinkLocalIPv6: true\n", strings.Join(c.cidrs, ", "))
}

// maps is the pinned nonmasq maps' content once the config is applied, as
// waitMaps compares it.
func (c chaosConfig) maps() string {
	var lines []string
	for _, cidr := range c.cidrs {
		lines = append(lines, fmt.Sprintf("nonmasq_v4 %s no-masquerade\n", cidr))
	}
	slices.Sort(lines)
	return strings.Join(lines, "")
}

// rules is the endpoint's ip rules once the config is applied.
func (c chaosConfig) rules(ep netip.Addr, table uint32) string {
	var b strings.Builder
	for _, cidr := range c.cidrs {
		fmt.Fprintf(&b, "111: from %s to %s lookup %d\n", ep, cidr, table)
	}
	return sortedRules(b.String())
}

// flowLog counts the flows of one kind and keeps why each lost one was
// lost, with the moment relative to the agent's lifecycle.
type flowLog struct {
	kind      string
	attempted atomic.Int64
	succeeded atomic.Int64
	mu        sync.Mutex
	losses    []string
}

func (l *flowLog) lost(tl *timeline, dst netip.Addr, why string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.losses = append(l.losses, fmt.Sprintf("%s flow to %s: %s (%s)", l.kind, dst, why, tl.where(time.Now())))
}

// timeline records the agent's lifecycle so a lost flow can be placed:
// while an agent was being killed, down, starting or converged.
type timeline struct {
	start  time.Time
	mu     sync.Mutex
	events []timelineEvent
}

type timelineEvent struct {
	at   time.Time
	what string
}

func (tl *timeline) mark(what string) {
	tl.mu.Lock()
	tl.events = append(tl.events, timelineEvent{time.Now(), what})
	tl.mu.Unlock()
}

func (tl *timeline) where(at time.Time) string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	last := "before any event"
	for _, e := range tl.events {
		if e.at.After(at) {
			break
		}
		last = fmt.Sprintf("%s at +%v", e.what, e.at.Sub(tl.start).Round(time.Millisecond))
	}
	return fmt.Sprintf("at +%v, after %s", at.Sub(tl.start).Round(time.Millisecond), last)
}

// udpOnce sends one datagram from a new pod socket and waits for the
// answer: no retry, so a datagram that left unmasqueraded is a lost flow.
func udpOnce(pod *topology.Netns, dst netip.Addr) (string, error) {
	return udpAsk(pod, dst, 1, 2*time.Second)
}

// TestRestartChaos: the agent killed (SIGKILL) at random points of its
// start and of a config change, then restarted, 20 times, while the pod
// keeps opening new TCP, UDP and ICMP flows and two long TCP streams run.
// ext has no route back to the pod, so a flow that leaves unmasqueraded
// (or whose translation is lost) cannot complete: every such flow is
// counted as lost, and there must be none. After each restart the pinned
// maps, the tc links and an endpoint's ip rules converge to the config.
func TestRestartChaos(t *testing.T) {
	const restarts = 20
	configs := []chaosConfig{
		{cidrs: []string{"172.16.0.0/12"}},
		{cidrs: []string{"172.16.0.0/12", "192.168.0.0/16"}},
	}
	rng := rand.New(rand.NewPCG(chaosSeed, chaosSeed))
	t.Logf("seed %d", chaosSeed)

	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	dsts := []netip.Addr{topology.RemoteIP4, topology.RemoteIP6, topology.ExtIP4, topology.ExtIP6}
	startServers(t, topo.Ext, dsts...)
	cur := 0
	a := newAgent(t, topo.Node, configs[cur].file())
	a.start()
	a.waitMaps(configs[cur].maps())

	// An endpoint with its own route table: its ip rules must survive
	// the crashes and follow the config.
	const table = 11
	client := ipamapi.NewClient(filepath.Join(a.dir, "api.sock"))
	rt := uint32(table)
	ep, err := client.Allocate(context.Background(), ipamapi.AllocationRequest{Owner: "chaos/eth0", Family: "ipv4", RouteTable: &rt})
	if err != nil {
		t.Fatalf("allocate endpoint: %v", err)
	}
	converged := func(what string) {
		t.Helper()
		a.waitMaps(configs[cur].maps())
		want := configs[cur].rules(ep.IP, table)
		a.waitFor(what+": the endpoint's ip rules", func() bool {
			return endpointRules(t, topo.Node, ep.IP) == want
		})
	}
	converged("at start")

	tl := &timeline{start: time.Now()}
	streams := []*stream{startStream(t, topo.Pod, topology.RemoteIP4), startStream(t, topo.Pod, topology.RemoteIP6)}
	for _, s := range streams {
		s.progress(t, 16<<10, "before the restarts")
	}

	// New flows, one after another per kind, for the whole test. The
	// pause keeps the number of flows (and NAT ports in TIME_WAIT) modest.
	tcp, udp, icmp := &flowLog{kind: "tcp"}, &flowLog{kind: "udp"}, &flowLog{kind: "ping"}
	var stop atomic.Bool
	var wg sync.WaitGroup
	loop := func(l *flowLog, flow func(dst netip.Addr) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				dst := dsts[i%len(dsts)]
				l.attempted.Add(1)
				if err := flow(dst); err != nil {
					l.lost(tl, dst, err.Error())
				} else {
					l.succeeded.Add(1)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	nodeAddr := func(dst netip.Addr) string {
		if dst.Is4() {
			return topology.NodeIP4.String()
		}
		return topology.NodeIP6.String()
	}
	loop(tcp, func(dst netip.Addr) error {
		begin := time.Now()
		seen, err := tcpSource(topo.Pod, dst)
		switch {
		case err != nil:
			return err
		case seen != nodeAddr(dst):
			return fmt.Errorf("server saw %s", seen)
		case time.Since(begin) > 900*time.Millisecond:
			// A retransmitted SYN: the first one was lost.
			return fmt.Errorf("handshake took %v", time.Since(begin).Round(time.Millisecond))
		}
		return nil
	})
	loop(udp, func(dst netip.Addr) error {
		seen, err := udpOnce(topo.Pod, dst)
		if err == nil && seen != nodeAddr(dst) {
			err = fmt.Errorf("server saw %s", seen)
		}
		return err
	})
	var pingID atomic.Uint32
	pingID.Store(1000)
	loop(icmp, func(dst netip.Addr) error {
		return ping(topo.Pod, dst, uint16(pingID.Add(1)), 1)
	})

	// Report the flows even when a convergence check gives up midway.
	var streamed int64
	defer func() {
		stop.Store(true)
		wg.Wait()
		var lost int64
		for _, l := range []*flowLog{tcp, udp, icmp} {
			n := l.attempted.Load() - l.succeeded.Load()
			lost += n
			if n > 0 {
				t.Errorf("%d of %d %s flows lost:\n  %s", n, l.attempted.Load(), l.kind, strings.Join(l.losses, "\n  "))
			}
		}
		t.Logf("restarts=%d tcp flows=%d udp flows=%d pings=%d streams=%d lost=%d (bytes streamed %d)",
			restarts, tcp.attempted.Load(), udp.attempted.Load(), icmp.attempted.Load(), len(streams), lost, streamed)
	}()

	for r := range restarts {
		what := "kill after start"
		a.stop(syscall.SIGKILL) // the converged agent of the last round
		tl.mark(fmt.Sprintf("round %d: converged agent killed", r))
		a.start()
		delay := time.Duration(rng.IntN(300)) * time.Millisecond
		if r%2 == 0 {
			// Kill while the new config is being reconciled.
			cur = 1 - cur
			a.writeConfig(configs[cur].file())
			what = fmt.Sprintf("kill after config %v", configs[cur].cidrs)
		}
		tl.mark(fmt.Sprintf("round %d: started, %s in %v", r, what, delay))
		time.Sleep(delay)
		a.stop(syscall.SIGKILL)
		tl.mark(fmt.Sprintf("round %d: killed", r))
		a.start()
		tl.mark(fmt.Sprintf("round %d: restarted", r))
		converged(fmt.Sprintf("round %d", r))
		tl.mark(fmt.Sprintf("round %d: converged", r))
		for _, s := range streams {
			s.progress(t, 4<<10, fmt.Sprintf("after round %d", r))
		}
	}
	time.Sleep(200 * time.Millisecond) // flows after the last restart too
	stop.Store(true)
	wg.Wait()
	for _, s := range streams {
		streamed += s.echoed.Load()
		s.stop(t)
	}
}
