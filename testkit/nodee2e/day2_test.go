package nodee2e

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// stream is a pod's one TCP connection to the external host, watched
// across day-2 operations on the agent.
type stream struct {
	c    *cluster
	pod  string
	last uint64
}

// startStream runs a pod that streams to the external host and waits for
// its connection.
func (c *cluster) startStream(pod string) *stream {
	c.runPod(pod, "stream", masqStream)
	s := &stream{c: c, pod: pod}
	c.eventually(20*time.Second, pod+"'s stream", func() error {
		if len(c.seen.streamsOf(pod)) == 0 {
			return fmt.Errorf("no connection yet")
		}
		return nil
	})
	s.check("start")
	return s
}

// check fails the test unless the pod still has exactly its first
// connection, from the node's address, with every counter in order, and
// it moved on by at least a second's worth (100 counters) since the last
// check. It asks only the external host, so it works while the API server
// is down. (The pod never restarts: podprog exits on any error and the
// pod's restartPolicy is Never, so a broken stream cannot come back as a
// new one unnoticed.)
func (s *stream) check(after string) {
	t := s.c.t
	t.Helper()
	var n uint64
	s.c.eventually(30*time.Second, s.pod+"'s stream moving after "+after, func() error {
		conns := s.c.seen.streamsOf(s.pod)
		if len(conns) != 1 {
			t.Fatalf("after %s: %s made %d stream connections, want its first only (no reconnect)", after, s.pod, len(conns))
		}
		if conns[0].From.String() != nodeIP {
			t.Fatalf("after %s: %s's stream arrives from %s, want the node's %s", after, s.pod, conns[0].From, nodeIP)
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
	// ipmasq-cni reaches the agent: pods can be created and deleted.
	if s.c.ipmasqCNI {
		s.c.eventually(30*time.Second, "the agent's API socket answering after "+after, func() error {
			_, err := s.c.tryAllocations()
			return err
		})
	}
	t.Logf("after %s: %s's stream at %d counters, one connection, all in order", after, s.pod, n)
	s.last = n
}

// editConfigMap adds cidr to nonMasqueradeCIDRs of deploy/config's ConfigMap, as
// `kubectl edit` would; the kubelet updates the mounted file.
func (c *cluster) editConfigMap(cidr string) {
	t := c.t
	ctx := context.Background()
	cms := c.admin.CoreV1().ConfigMaps("kube-system")
	cm, err := cms.Get(ctx, "ip-masq-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cm.Data) != 1 {
		t.Fatalf("ConfigMap ip-masq-agent has keys %v, want the one config file", cm.Data)
	}
	for k, v := range cm.Data {
		const key = "nonMasqueradeCIDRs:\n"
		if !strings.Contains(v, key) {
			t.Fatalf("ConfigMap ip-masq-agent key %s has no block list nonMasqueradeCIDRs:\n%s", k, v)
		}
		cm.Data[k] = strings.Replace(v, key, key+"  - "+cidr+"\n", 1)
	}
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// killAgentContainer kills the agent's container with SIGKILL through the
// runtime, as an OOM kill or a crash would end it, and returns its restart
// count before.
func (c *cluster) killAgentContainer() int32 {
	t := c.t
	pod := c.agentPod(10 * time.Second)
	st := pod.Status.ContainerStatuses[0]
	id, ok := strings.CutPrefix(st.ContainerID, "containerd://")
	if !ok {
		t.Fatalf("agent container ID %q is not containerd's", st.ContainerID)
	}
	c.node.MustRun("ctr", "-n", "k8s.io", "tasks", "kill", "--signal", "SIGKILL", id)
	return st.RestartCount
}

// agentRestarted waits for the agent's container to have restarted since
// before and to be Ready again.
func (c *cluster) agentRestarted(before int32) {
	c.eventually(90*time.Second, "the agent container restarted and Ready", func() error {
		pod := c.agentPod(90 * time.Second)
		if n := pod.Status.ContainerStatuses[0].RestartCount; n <= before {
			return fmt.Errorf("restart count %d", n)
		}
		return nil
	})
}

// rollTo sets the DaemonSet's image and waits until the node's agent pod
// runs it and is Ready.
func (c *cluster) rollTo(image string) {
	t := c.t
	ctx := context.Background()
	dss := c.admin.AppsV1().DaemonSets("kube-system")
	ds, err := dss.Get(ctx, "ipmasq-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	setImage(t, ds, image)
	if _, err := dss.Update(ctx, ds, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.eventually(120*time.Second, "the agent rolled to "+image, func() error {
		pod := c.agentPod(120 * time.Second)
		if got := pod.Spec.Containers[0].Image; got != image {
			return fmt.Errorf("pod %s runs %s", pod.Name, got)
		}
		// Restarts would say the new agent started while the old one
		// still held the node (its state lock, its port).
		t.Logf("new agent pod %s: %d restarts", pod.Name, pod.Status.ContainerStatuses[0].RestartCount)
		return nil
	})
}

// testDay2 runs the operations an operator does on a running node, each
// with a pod's TCP stream through the node's datapath running through it.
func testDay2(t *testing.T, c *cluster) {
	s := c.startStream("streamer")

	// ConfigMap edit: the kubelet's projected update reaches the agent,
	// which adds the new CIDR's rule to every endpoint.
	step := time.Now()
	c.editConfigMap("198.18.0.0/15")
	ip := c.podIP("streamer")
	c.eventually(90*time.Second, "the edited ConfigMap's CIDR in the pods' ip rules", func() error {
		for _, r := range c.rulesFrom(ip) {
			if strings.Contains(r, "to 198.18.0.0/15 ") {
				return nil
			}
		}
		return fmt.Errorf("rules from %s: %v", ip, c.rulesFrom(ip))
	})
	t.Logf("ConfigMap edit applied in %v", time.Since(step).Round(time.Millisecond))
	s.check("the ConfigMap edit")

	// Rolling update to a second tag of the image.
	step = time.Now()
	c.node.MustRun("ctr", "-n", "k8s.io", "images", "tag", agentImageV1, agentImageV2)
	c.rollTo(agentImageV2)
	t.Logf("rolled to %s in %v", agentImageV2, time.Since(step).Round(time.Millisecond))
	s.check("the rolling update")

	// The agent's container killed: the kubelet restarts it.
	step = time.Now()
	c.agentRestarted(c.killAgentContainer())
	t.Logf("agent container restarted and Ready in %v", time.Since(step).Round(time.Millisecond))
	s.check("the agent's container was killed")

	// The API server stopped for 30 s.
	c.api.Kill()
	time.Sleep(15 * time.Second)
	s.check("15 s without the API server")
	time.Sleep(15 * time.Second)
	c.api.Restart()
	c.agentPod(60 * time.Second)
	s.check("the API server's 30 s outage")
}

// podIP is a pod's address.
func (c *cluster) podIP(name string) netip.Addr {
	p, err := c.admin.CoreV1().Pods("default").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	return mustAddr(c.t, p.Status.PodIP)
}
