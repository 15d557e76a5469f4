package e2e

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/reconcilers/tcattach"
)

// The migration of docs/migrate.md on one node, item 7 of issue 30: from
// the Kubernetes ip-masq-agent's rules (upstreamRules: the chain its first
// sync writes, iptables-nft in the node namespace) to ipmasq, and back,
// with a TCP stream started under each agent and a burst of UDP queries
// (each its own flow) running throughout. Every stream stays one
// connection, every query is answered from the node's address, and no
// packet reaches ext with a pod address.

// migrationConfig is the file of both agents: the remotes are masqueraded,
// the node's own subnet is not.
const migrationConfig = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: false\n"

var migrationCase = upstreamCase{name: "migration", file: file(migrationConfig)}

// upstreamChain installs the Kubernetes agent's IPv4 rules in node.
func upstreamChain(t *testing.T, node *topology.Netns) {
	t.Helper()
	for _, rule := range upstreamRules(migrationCase, false) {
		if err := node.Iptables(false, rule...); err != nil {
			t.Fatal(err)
		}
	}
}

// removeUpstreamChain is docs/migrate.md's removal of the chain (the
// POSTROUTING jump, then the chain flushed and deleted).
func removeUpstreamChain(t *testing.T, node *topology.Netns) {
	t.Helper()
	for _, rule := range [][]string{
		{"-t", "nat", "-D", "POSTROUTING", "-m", "addrtype", "!", "--dst-type", "LOCAL", "-j", "IP-MASQ-AGENT"},
		{"-t", "nat", "-F", "IP-MASQ-AGENT"},
		{"-t", "nat", "-X", "IP-MASQ-AGENT"},
	} {
		if err := node.Iptables(false, rule...); err != nil {
			t.Fatal(err)
		}
	}
}

// queryTraces records the query port's datagrams on the node's two links
// (the pod's and the uplink), and the node's conntrack UDP events, and
// returns what tells of one unanswered query: its conntrack events (by its
// pod port) and the datagrams around the time it was asked.
func queryTraces(t *testing.T, topo *topology.Masquerade) func(badQuery) string {
	uplink := traceUDP(t, topo.Node, "eth0", udpPort)
	podSide := traceUDP(t, topo.Node, "pod0", udpPort)
	remote := traceUDP(t, topo.Ext, "eth0", udpPort)
	events := recordConntrackUDP(t, topo.Node)
	return func(b badQuery) string {
		from, to := b.asked.Add(-100*time.Millisecond), b.asked.Add(300*time.Millisecond)
		return fmt.Sprintf("conntrack's UDP events of sport=%d in %s:\n%s\n%s\n%s\n%s", b.local.Port(), topo.Node.Name,
			events.mentioning(fmt.Sprintf("sport=%d ", b.local.Port())), podSide.around(from, to), uplink.around(from, to), remote.around(from, to))
	}
}

// queryBurst asks the remote over UDP from a new pod socket every 20 ms
// until stopped, and counts the queries not answered (one try, 2 s) or
// answered with another source than the node's.
type queryBurst struct {
	// step names the test's step, for the report of a query that failed
	stepMu sync.Mutex
	step   string
	stopc  chan struct{}
	wg     sync.WaitGroup
	mu     sync.Mutex
	asked  int
	bad    []string
	// badAt are the unanswered queries' times and local ends, for the
	// report (the traces of why, if any).
	badAt []badQuery
	// why, if set, tells what the node's and the remote's links and
	// conntrack saw of an unanswered query.
	why func(q badQuery) string
	// agentLog, if set, is the agent's log, whose lines around an
	// unanswered query the report shows.
	agentLog string
}

// badQuery is a query not answered as it should have been.
type badQuery struct {
	asked time.Time
	local netip.AddrPort
}

func startQueryBurst(pod *topology.Netns, dst netip.Addr) *queryBurst {
	q := &queryBurst{stopc: make(chan struct{})}
	q.wg.Add(1)
	go func() {
		defer q.wg.Done()
		var inflight sync.WaitGroup
		defer inflight.Wait()
		for i := 0; ; i++ {
			select {
			case <-q.stopc:
				return
			case <-time.After(20 * time.Millisecond):
			}
			inflight.Add(1)
			go func() {
				defer inflight.Done()
				asked, at := q.currentStep(), time.Now()
				seen, local, err := udpAskFrom(pod, dst, 1, answerWait)
				q.mu.Lock()
				defer q.mu.Unlock()
				q.asked++
				if err != nil || seen != topology.NodeIP4.String() {
					q.bad = append(q.bad, fmt.Sprintf("query %d (asked at step %q, over at %q, at %s from %s): answer %q, %v",
						i, asked, q.currentStep(), at.Format("15:04:05.000"), local, seen, err))
					q.badAt = append(q.badAt, badQuery{asked: at, local: local})
				}
			}()
		}
	}()
	return q
}

// setStep names the step the test is at.
func (q *queryBurst) setStep(step string) {
	q.stepMu.Lock()
	defer q.stepMu.Unlock()
	q.step = step
}

func (q *queryBurst) currentStep() string {
	q.stepMu.Lock()
	defer q.stepMu.Unlock()
	return q.step
}

func (q *queryBurst) stop(t *testing.T) {
	t.Helper()
	close(q.stopc)
	q.wg.Wait()
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.bad) > 0 {
		t.Errorf("%d of %d UDP queries not answered from the node's address; first: %s", len(q.bad), q.asked, q.bad[0])
		for i, b := range q.badAt {
			if q.why == nil || i == 3 {
				break
			}
			t.Logf("unanswered query from %s:\n%s\nthe agent's log from 2 s before to 1 s after:\n%s", b.local, q.why(b),
				logAround(q.agentLog, b.asked.Add(-2*time.Second), b.asked.Add(time.Second)))
		}
	}
	t.Logf("%d UDP queries, all answered from the node's address", q.asked)
}

// broken says whether s broke or stalled within d.
func (s *stream) broken(d time.Duration) bool {
	start := s.echoed.Load()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		select {
		case <-s.errc:
			return true
		default:
		}
		if s.echoed.Load() > start+256<<10 {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

// kubeProxyConntrackRule is what kube-proxy (iptables mode) writes on
// every node, and what keeps conntrack tracking the node namespace's
// packets whatever else is removed: KUBE-FORWARD's drop of INVALID
// packets. Without any rule that uses conntrack, the kernel stops tracking
// the namespace's packets when the last one goes (the Kubernetes agent's
// chain), and the flows conntrack translated leave untranslated.
func kubeProxyConntrackRule(t *testing.T, node *topology.Netns) {
	t.Helper()
	for _, rule := range [][]string{
		{"-N", "KUBE-FORWARD"},
		{"-A", "FORWARD", "-m", "comment", "--comment", "kubernetes forwarding rules", "-j", "KUBE-FORWARD"},
		{"-A", "KUBE-FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"},
	} {
		if err := node.Iptables(false, rule...); err != nil {
			t.Fatal(err)
		}
	}
}

// TestMigrationKeepsFlows runs docs/migrate.md's order on a node with
// kube-proxy's conntrack rule: ipmasq started beside the Kubernetes
// agent's chain, the chain removed, then the way back (the chain
// installed again, ipmasq uninstalled). With --conntrack-handover=false
// the same run must break (the stream ipmasq translated leaves with the
// pod's address, or breaks, once ipmasq is gone): the reference that shows
// the run detects what the handover prevents.
func TestMigrationKeepsFlows(t *testing.T) {
	t.Run("handover", func(t *testing.T) { testMigration(t, true) })
	t.Run("no-handover", func(t *testing.T) { testMigration(t, false) })
}

func testMigration(t *testing.T, handover bool) {
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	startServers(t, topo.Ext, topology.RemoteIP4)
	// For the report of a stream that broke: its segments on both ends
	// and conntrack's entries.
	traceTCP(t, topo.Ext, "eth0", tcpPort)
	traceTCP(t, topo.Pod, "eth0", tcpPort)
	conntrackTable(t, topo.Node, tcpPort)
	conntrackEvents(t, topo.Node)
	kubeProxyConntrackRule(t, topo.Node)
	leaks := watchLeaks(t, topo.Ext, "eth0", topology.PodCIDR4)
	// Without tcx (Linux before 6.6) the node is prepared as
	// docs/deploy.md ("Kernels without tcx") says: the uplink's clsact
	// qdisc made before traffic, so the agent's start grafts none (a graft
	// drops what the uplink sends meanwhile, whatever decides:
	// TestClsactQdiscGraftDropsForwarded).
	clsactBeforeTraffic := !tcxAvailable(t, topo.Node)
	if clsactBeforeTraffic {
		// The command docs/deploy.md gives.
		tc := exec.Command("tc", "qdisc", "add", "dev", "eth0", "clsact")
		var out bytes.Buffer
		tc.Stdout, tc.Stderr = &out, &out
		if err := topo.Node.Start(tc); err != nil {
			t.Fatalf("tc (Debian package iproute2): %v", err)
		}
		if err := tc.Wait(); err != nil {
			t.Fatalf("the uplink's clsact qdisc before traffic: tc: %v\n%s", err, out.String())
		}
	}

	// 1. The Kubernetes agent decides: a stream and queries under it.
	upstreamChain(t, topo.Node)
	underUpstream := startStream(t, topo.Pod, topology.RemoteIP4)
	underUpstream.progress(t, 64<<10, "under the Kubernetes agent's chain")
	queries := startQueryBurst(topo.Pod, topology.RemoteIP4)
	queries.why = queryTraces(t, topo)
	queries.setStep("1. the Kubernetes agent's chain alone")

	// 2. ipmasq starts beside the chain and adopts conntrack's bindings.
	queries.setStep("2. ipmasq started beside the chain")
	a := newAgent(t, topo.Node, migrationConfig)
	queries.agentLog = a.log
	if !handover {
		a.args = []string{"--conntrack-handover=false"}
	}
	a.start()
	if n := a.logLines(tcattach.QdiscCreatedMsg); clsactBeforeTraffic && n != 0 {
		t.Fatalf("the agent created the uplink's clsact qdisc, which was made before traffic (%d log lines)", n)
	}
	if handover {
		a.waitHandover("active", func(s string) bool {
			return strings.HasPrefix(s, "active") && !strings.Contains(s, " 0 flow(s) adopted")
		})
	}
	underUpstream.progress(t, 64<<10, "with ipmasq beside the chain")

	// 3. The chain goes: conntrack keeps translating the flows it has,
	// ipmasq masquerades the new ones.
	queries.setStep("3. the chain removed")
	removeUpstreamChain(t, topo.Node)
	underUpstream.progress(t, 256<<10, "after the upstream chain was removed")
	if handover {
		a.waitHandover("idle", func(s string) bool { return strings.HasPrefix(s, "idle") })
	}
	underIPMasq := startStream(t, topo.Pod, topology.RemoteIP4)
	underIPMasq.progress(t, 64<<10, "under ipmasq")
	underUpstream.progress(t, 64<<10, "under ipmasq")
	time.Sleep(2 * time.Second) // queries under ipmasq alone

	// 4. The way back: the chain again (the agent reads netfilter a second
	// after nftables tells of the change); ipmasq hands its pairs to
	// conntrack.
	queries.setStep("4. the chain back: the hand-back")
	upstreamChain(t, topo.Node)
	underIPMasq.progress(t, 64<<10, "with the upstream chain back beside ipmasq")
	if handover {
		a.waitHandover("pairs handed back", func(s string) bool {
			return strings.HasPrefix(s, "active") && !strings.Contains(s, " 0 handed back")
		})
	} else {
		time.Sleep(3 * time.Second)
	}
	underIPMasq.progress(t, 64<<10, "after the hand-back")
	underUpstream.progress(t, 64<<10, "after the hand-back")

	// 5. ipmasq goes: stopped and uninstalled (programs detached, maps
	// gone); conntrack translates every flow.
	queries.setStep("5. ipmasq stopped and uninstalled")
	// The counters go with the uninstall: kept for the report of a failure.
	counters := a.counters()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("datapath counters before the uninstall:\n%s", counters)
		}
	})
	a.stop(syscall.SIGTERM)
	flags := []string{
		"--bpf-root=" + a.bpfRoot,
		"--state-dir=" + filepath.Join(a.dir, "state"),
		"--api-socket=" + filepath.Join(a.dir, "api.sock"),
		"--shell-sock-path=" + filepath.Join(a.dir, "shell.sock"),
	}
	if out, errOut, err := runUninstall(topo.Node, flags); err != nil {
		t.Fatalf("uninstall: %v\n%s%s", err, out, errOut)
	}
	if !handover {
		if !underIPMasq.broken(5*time.Second) && leaks.count() == 0 {
			t.Fatal("without the handover, the stream ipmasq translated survived its uninstall without a leak: the test would prove nothing")
		}
		t.Logf("without the handover: the stream ipmasq translated broke when ipmasq went (%d packet(s) reached ext with the pod's address)", leaks.count())
		return
	}
	underIPMasq.progress(t, 256<<10, "after ipmasq was uninstalled")
	queries.setStep("5. the chain alone")
	underUpstream.progress(t, 256<<10, "after ipmasq was uninstalled")
	time.Sleep(2 * time.Second) // queries under the chain alone

	queries.stop(t)
	underIPMasq.stop(t)
	underUpstream.stop(t)
	leaks.check(t)
}

// waitHandover waits (up to the netfilter scan's interval and some) until
// the status's Handover line satisfies ok.
func (a *agent) waitHandover(what string, ok func(line string) bool) {
	a.t.Helper()
	t, _ := a.t.(*testing.T)
	deadline := time.Now().Add(45 * time.Second)
	var line string
	for time.Now().Before(deadline) {
		for l := range strings.SplitSeq(a.status(t), "\n") {
			if v, found := strings.CutPrefix(l, "Handover:"); found {
				line = strings.TrimSpace(v)
			}
		}
		if ok(line) {
			a.t.Logf("handover %s: %s", what, line)
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	a.t.Fatalf("handover not %s within 45 s: %q", what, line)
}

// logAround returns the lines of the agent's log at path stamped from from
// to to.
func logAround(path string, from, to time.Time) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	var lines []string
	for l := range strings.SplitSeq(string(data), "\n") {
		stamp, _, ok := strings.Cut(strings.TrimPrefix(l, "time="), " ")
		at, err := time.Parse(time.RFC3339Nano, stamp)
		if ok && err == nil && !at.Before(from) && !at.After(to) {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, "\n")
}
