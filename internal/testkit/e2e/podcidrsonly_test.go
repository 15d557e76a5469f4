package e2e

import (
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/internal/topology"
)

// podCIDRsOnlyConfig is ipmasq's file for the --masquerade-pod-cidrs-only
// tests, and podCIDRsOnlyNonMasq the same ranges as the reference's
// "! -d": the cluster's pod ranges are not masqueraded.
const podCIDRsOnlyConfig = "nonMasqueradeCIDRs: [10.244.0.0/16, fd00::/8]\nmasqLinkLocal: false\n"

var podCIDRsOnlyNonMasq = map[bool]string{false: "10.244.0.0/16", true: "fd00::/8"}

// notReadyFor is how long a not-ready agent is watched: the condition must
// hold all along, not only while the agent starts.
const notReadyFor = 5 * time.Second

// TestPodCIDRsOnlyNotReadyWithoutPodCIDR: with --masquerade-pod-cidrs-only
// and no pod CIDR known (no --pod-cidr, --cluster-cidr or Node), nothing is
// masqueraded, so the agent is not Ready: /readyz is not 200 for as long
// as it runs so, and /readyz, /healthz and `status` say why (a migration
// waiting on readiness keeps the old chain). Restarted with --pod-cidr, as
// an operator fixes it, it is Ready and the pod's connections reach the
// far side from the node's address, as under the reference: Linux
// MASQUERADE for the pod CIDRs except the cluster's range
// (-s <pod CIDR> ! -d <non-masquerade> -j MASQUERADE) on the same
// topology, where ext has a route back to the pods (an unmasqueraded flow
// is answered, and seen from the pod's address).
func TestPodCIDRsOnlyNotReadyWithoutPodCIDR(t *testing.T) {
	referenceFailed := false
	reference := masquerader{name: "MASQUERADE", start: func(t *testing.T, topo *topology.Masquerade) {
		if err := topo.RouteBack(); err != nil {
			t.Fatal(err)
		}
		for _, src := range podSources {
			v6 := netip.MustParsePrefix(src).Addr().Is6()
			if err := topo.Node.Iptables(v6, "-t", "nat", "-A", "POSTROUTING", "-s", src, "!", "-d", podCIDRsOnlyNonMasq[v6], "-j", "MASQUERADE"); err != nil {
				t.Fatal(err)
			}
		}
	}}
	var a *agent
	ipmasq := masquerader{name: "ipmasq", start: func(t *testing.T, topo *topology.Masquerade) {
		if referenceFailed {
			t.Fatal("the reference (Linux MASQUERADE) failed on this topology: the scenario proves nothing")
		}
		if err := topo.RouteBack(); err != nil {
			t.Fatal(err)
		}
		a = newAgent(t, topo.Node, podCIDRsOnlyConfig)
		a.noPodCIDR = true
		a.args = []string{"--masquerade-pod-cidrs-only", "--prometheus-serve-addr=" + metricsAddr}
		// The programs are attached (the datapath is up): only the
		// missing source keeps it from being ready.
		a.start()
	}}
	runEach(t, []masquerader{reference, ipmasq}, func(t *testing.T, topo *topology.Masquerade) {
		if a == nil {
			t.Cleanup(func() { referenceFailed = t.Failed() })
		}
		startServers(t, topo.Ext, topology.RemoteIP4, topology.RemoteIP6)
		if a != nil {
			expectNotReadyWithoutSource(t, topo.Node, func() string { return a.status(t) })
			// Not ready for a reason: the pod's connections leave
			// unmasqueraded (ext routes them back).
			for _, c := range []struct{ dst, pod netip.Addr }{{topology.RemoteIP4, topology.PodIP4}, {topology.RemoteIP6, topology.PodIP6}} {
				if seen, err := tcpSource(topo.Pod, c.dst); err != nil || seen != c.pod.String() {
					t.Errorf("TCP from the pod to %s with no source: seen from %q (%v), want the pod's own %s", c.dst, seen, err, c.pod)
				}
			}

			// The operator's fix: the pod CIDRs on the command line.
			a.stop(syscall.SIGTERM)
			a.noPodCIDR = false
			a.start()
			a.waitReady()
			if status := a.status(t); !strings.Contains(status, "Readiness:  ready\n") {
				t.Errorf("with --pod-cidr, status does not say ready:\n%s", status)
			}
		}

		leaks := watchLeaks(t, topo.Ext, "eth0", podSources...)
		for _, c := range []struct {
			dst, want netip.Addr
		}{{topology.RemoteIP4, topology.NodeIP4}, {topology.RemoteIP6, topology.NodeIP6}} {
			if seen, err := tcpSource(topo.Pod, c.dst); err != nil || seen != c.want.String() {
				t.Errorf("TCP from the pod to %s: seen from %q (%v), want the node's %s", c.dst, seen, err, c.want)
			}
			if seen, err := udpSource(topo.Pod, c.dst); err != nil || seen != c.want.String() {
				t.Errorf("UDP from the pod to %s: seen from %q (%v), want the node's %s", c.dst, seen, err, c.want)
			}
		}
		leaks.check(t)
	})
}

// expectNotReadyWithoutSource checks, for notReadyFor, that the agent in
// node (serving on metricsAddr, with --masquerade-pod-cidrs-only and no
// pod CIDR) is not ready, and that /readyz, /healthz and status (its
// `ipmasq-agent status`) say why.
func expectNotReadyWithoutSource(t *testing.T, node *topology.Netns, status func() string) {
	t.Helper()
	const why = "sources: no source is masqueraded: --masquerade-pod-cidrs-only and no pod CIDR is known"
	// The server may not listen yet: wait for its first answer.
	var code int
	var body string
	var err error
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if code, body, err = httpGet(node, metricsAddr, "/readyz"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz never answered: %v", err)
		}
	}
	checks := 0
	for start := time.Now(); time.Since(start) < notReadyFor; time.Sleep(100 * time.Millisecond) {
		c, b, err := httpGet(node, metricsAddr, "/readyz")
		if err != nil {
			t.Fatalf("/readyz after %v: %v", time.Since(start).Round(time.Millisecond), err)
		}
		if c == http.StatusOK || !strings.Contains(b, why) {
			t.Fatalf("/readyz after %v with --masquerade-pod-cidrs-only and no pod CIDR: %d %q, want not 200 naming %q",
				time.Since(start).Round(time.Millisecond), c, b, why)
		}
		code, body = c, b
		checks++
	}
	t.Logf("/readyz not ready for %v (%d checks): %d %q", notReadyFor, checks, code, body)

	if c, b, err := httpGet(node, metricsAddr, "/healthz"); err != nil || c != http.StatusServiceUnavailable || !strings.Contains(b, "readiness") {
		t.Errorf("/healthz with no source: %d %q (%v), want 503 naming the degraded scope readiness", c, b, err)
	} else {
		t.Logf("/healthz: %d %q", c, b)
	}
	st := status()
	if !strings.Contains(st, "Readiness:  NOT READY: ") || !strings.Contains(st, why) {
		t.Errorf("status with no source does not say NOT READY and why (%q):\n%s", why, st)
	}
	if strings.Contains(st, "remove the old chain") {
		t.Errorf("status tells to remove the old chain on a node that is not ready:\n%s", st)
	}
}
