package nodee2e

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
)

// fleetStream is one pod's TCP stream to the external host, through its
// node's datapath.
type fleetStream struct {
	f    *fleet
	n    *fleetNode
	pod  string
	last uint64
}

// startStreams runs a streaming pod on every running node.
func (f *fleet) startStreams(prefix string) []*fleetStream {
	var out []*fleetStream
	for _, n := range f.nodes {
		if n.stopped {
			continue
		}
		pod := fmt.Sprintf("%s-%d", prefix, n.index)
		f.runPodOn(n, pod, nil, "stream", masqStream)
		s := &fleetStream{f: f, n: n, pod: pod}
		f.eventually(20*time.Second, pod+"'s stream", func() error {
			if len(f.seen.streamsOf(pod)) == 0 {
				return fmt.Errorf("no connection yet")
			}
			return nil
		})
		out = append(out, s)
	}
	return out
}

// check fails the test unless the stream still is its first connection,
// from its node's address (masqueraded), every counter in order, and moved
// on by a second's worth since the last check. It asks only the external
// host: it works without the API server.
func (s *fleetStream) check(after string) {
	t := s.f.t
	t.Helper()
	var n uint64
	s.f.eventually(30*time.Second, s.pod+"'s stream moving after "+after, func() error {
		conns := s.f.seen.streamsOf(s.pod)
		if len(conns) != 1 {
			t.Fatalf("after %s: %s made %d stream connections, want its first only", after, s.pod, len(conns))
		}
		if conns[0].From != s.n.ip {
			t.Fatalf("after %s: %s's stream arrives from %s, want %s's %s", after, s.pod, conns[0].From, s.n.name, s.n.ip)
		}
		var err error
		n, err = conns[0].Progress()
		if err != nil {
			t.Fatalf("after %s: %s's stream ended after %d counters: %v", after, s.pod, n, err)
		}
		if n < s.last+100 {
			return fmt.Errorf("%d counters, %d before", n, s.last)
		}
		return nil
	})
	s.last = n
}

func checkStreams(streams []*fleetStream, after string) {
	for _, s := range streams {
		s.check(after)
	}
	if len(streams) > 0 {
		streams[0].f.t.Logf("after %s: %d streams moving, one connection each, from their nodes", after, len(streams))
	}
}

// mapHas says whether the node's nonmasq_v4 map (pinned in its bpffs)
// holds p.
func (n *fleetNode) mapHas(p netip.Prefix) (bool, error) {
	m, err := ebpf.LoadPinnedMap(n.Root("/sys/fs/bpf/ipmasq/nonmasq_v4"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return false, err
	}
	defer m.Close()
	var k bpf.LPMKeyV4
	var v uint8
	it := m.Iterate()
	for it.Next(&k, &v) {
		if k.Prefix() == p {
			return true, nil
		}
	}
	return false, it.Err()
}

// configReach edits the ConfigMap (adds cidr to nonMasqueradeCIDRs) and
// returns, per running node, the time from the edit until the node's map
// holds cidr. With nudge, the agent pods are annotated right after the
// edit, which makes every kubelet sync them (and swap the mounted file)
// at once instead of on its next periodic sync.
func (f *fleet) configReach(cidr string, nudge bool) map[string]time.Duration {
	p := netip.MustParsePrefix(cidr)
	begin := time.Now()
	f.editConfigMap(cidr)
	if nudge {
		f.nudgeAgents(cidr)
	}
	var mu sync.Mutex
	took := map[string]time.Duration{}
	var wg sync.WaitGroup
	for _, n := range f.nodes {
		if n.stopped {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for deadline := begin.Add(150 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
				if ok, _ := n.mapHas(p); ok {
					mu.Lock()
					took[n.name] = time.Since(begin)
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, n := range f.nodes {
		if !n.stopped && took[n.name] == 0 {
			f.t.Fatalf("%s's nonmasq_v4 map has no %s 150 s after the ConfigMap edit", n.name, cidr)
		}
	}
	return took
}

// nudgeAgents annotates every agent pod (docs/deploy.md: "Changing the
// config"): a pod update makes its kubelet sync it now, and the sync
// refreshes its ConfigMap volume.
func (f *fleet) nudgeAgents(value string) {
	ctx := context.Background()
	pods, err := f.admin.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ipmasq-agent"})
	if err != nil {
		f.t.Fatal(err)
	}
	for _, p := range pods.Items {
		patch := fmt.Sprintf(`{"metadata":{"annotations":{"ipmasq.io/config-edit":%q}}}`, value)
		if _, err := f.admin.CoreV1().Pods("kube-system").Patch(ctx, p.Name, "application/merge-patch+json", []byte(patch), metav1.PatchOptions{}); err != nil {
			f.t.Fatal(err)
		}
	}
}

// medianMax are the median and the maximum of the durations.
func medianMax(d map[string]time.Duration) (time.Duration, time.Duration) {
	var all []time.Duration
	for _, v := range d {
		all = append(all, v)
	}
	slices.Sort(all)
	if len(all) == 0 {
		return 0, 0
	}
	mid := all[len(all)/2]
	if len(all)%2 == 0 {
		mid = (all[len(all)/2-1] + all[len(all)/2]) / 2
	}
	return mid, all[len(all)-1]
}

// testFleetConfig is item 3 of issue 31: the time from a ConfigMap edit
// to every node's maps, with the kubelet's periodic sync (syncFrequency:
// the fleet's kubelets have 10 s, the default is 1 min) and with the
// agent pods annotated after the edit.
func testFleetConfig(t *testing.T, f *fleet, streams []*fleetStream) {
	plain := f.configReach("198.18.0.0/15", false)
	med, max := medianMax(plain)
	t.Logf("ConfigMap edit to every node's map, the kubelet's own sync (syncFrequency 10s): median %v, max %v over %d nodes: %v",
		med.Round(time.Millisecond), max.Round(time.Millisecond), len(plain), plain)
	nudged := f.configReach("100.64.0.0/10", true)
	med, max = medianMax(nudged)
	t.Logf("ConfigMap edit to every node's map, agent pods annotated after the edit: median %v, max %v over %d nodes: %v",
		med.Round(time.Millisecond), max.Round(time.Millisecond), len(nudged), nudged)
	checkStreams(streams, "two ConfigMap edits")
}

// nodeEvents are the agent's Events (source ipmasq-agent), as
// "node reason message" -> their count, and the number of Event objects.
func (f *fleet) nodeEvents() (map[string]int32, int) {
	evs, err := f.admin.CoreV1().Events(corev1.NamespaceAll).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	out := map[string]int32{}
	objects := 0
	for _, e := range evs.Items {
		if e.Source.Component != "ipmasq-agent" && e.ReportingController != "ipmasq-agent" {
			continue
		}
		objects++
		key := e.InvolvedObject.Name + " " + e.Reason + " " + e.Message
		if _, dup := out[key]; dup {
			f.t.Errorf("two Event objects for %q", key)
		}
		out[key] += max(e.Count, 1)
	}
	return out, objects
}

// testFleetOutage is item 7 of issue 31: the API server and etcd stopped
// for every node at once for 30 s, then back: every node keeps
// masquerading (the streams, and new connections of a dialing pod on each
// node), catches up (Ready agents, a new pod's address, a ConfigMap edit
// on every node's maps) and posts no Event twice.
func testFleetOutage(t *testing.T, f *fleet, streams []*fleetStream) {
	var dialers []string
	dialerNode := map[string]*fleetNode{}
	for _, n := range f.nodes {
		if !n.stopped {
			pod := fmt.Sprintf("outage-dial-%d", n.index)
			f.runPodOn(n, pod, nil, "dial", masqDial)
			dialers = append(dialers, pod)
			dialerNode[pod] = n
		}
	}
	// Something for every agent to post: a rejected config (Warning
	// IPMasqConfigRejected), then the good one back (IPMasqConfigAccepted).
	f.editConfigMap("10.0.0.1/8")
	f.nudgeAgents("bad")
	f.waitEvents("IPMasqConfigRejected")
	f.removeFromConfigMap("10.0.0.1/8")
	f.nudgeAgents("good")
	f.waitEvents("IPMasqConfigAccepted")
	before, objects := f.nodeEvents()
	t.Logf("before the outage: %d Event objects of the agents: %v", objects, before)
	counts := map[string]int{}
	for _, pod := range dialers {
		f.eventually(20*time.Second, pod+" dialing", func() error {
			for _, n := range f.seen.sources(pod, masqDial) {
				counts[pod] = n
				return nil
			}
			return fmt.Errorf("no connection yet")
		})
	}

	f.api.KillWithEtcd()
	time.Sleep(15 * time.Second)
	checkStreams(streams, "15 s without the API server and etcd")
	for _, pod := range dialers {
		n := dialerNode[pod]
		f.eventually(20*time.Second, pod+"'s new connections during the outage", func() error {
			got := f.seen.sources(pod, masqDial)
			for from := range got {
				if from != n.ip {
					t.Fatalf("during the outage %s's connections arrived from %s, want %s's %s", pod, from, n.name, n.ip)
				}
			}
			if got[n.ip] <= counts[pod] {
				return fmt.Errorf("%d connections, %d before", got[n.ip], counts[pod])
			}
			return nil
		})
	}
	time.Sleep(15 * time.Second)
	f.api.RestartWithEtcd()
	f.agentPodsReady(90 * time.Second)
	checkStreams(streams, "the API server's and etcd's 30 s outage")
	for _, n := range f.nodes {
		if !n.stopped {
			f.runPodOn(n, fmt.Sprintf("after-outage-%d", n.index), nil, "pause")
		}
	}
	took := f.configReach("198.51.100.0/24", true)
	med, mx := medianMax(took)
	t.Logf("after the outage, a ConfigMap edit reached every node's map: median %v, max %v", med.Round(time.Millisecond), mx.Round(time.Millisecond))
	// Time for anything an agent would post on reconnecting.
	time.Sleep(5 * time.Second)
	after, objects := f.nodeEvents()
	for k, n := range after {
		if before[k] != n {
			t.Errorf("after the outage the agents posted %q %d times, %d before", k, n, before[k])
		}
	}
	t.Logf("after the outage: %d Event objects of the agents, as before", objects)
}

// waitEvents waits until every running node's agent has posted an Event
// with reason.
func (f *fleet) waitEvents(reason string) {
	f.eventually(60*time.Second, "an Event "+reason+" from every agent", func() error {
		evs, err := f.admin.CoreV1().Events(corev1.NamespaceAll).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, n := range f.nodes {
			if n.stopped {
				continue
			}
			found := false
			for _, e := range evs.Items {
				found = found || (e.Reason == reason && e.InvolvedObject.Name == n.name)
			}
			if !found {
				return fmt.Errorf("none from %s", n.name)
			}
		}
		return nil
	})
}

// removeFromConfigMap takes cidr's line out of the ConfigMap's
// nonMasqueradeCIDRs (editConfigMap's inverse).
func (f *fleet) removeFromConfigMap(cidr string) {
	ctx := context.Background()
	cms := f.admin.CoreV1().ConfigMaps("kube-system")
	cm, err := cms.Get(ctx, "ip-masq-agent", metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	for k, v := range cm.Data {
		cm.Data[k] = strings.Replace(v, "  - "+cidr+"\n", "", 1)
	}
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		f.t.Fatal(err)
	}
}
