package k8snode_test

import (
	"context"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/ipmasq/ipmasq/internal/kubeclient"
)

// countingTransport counts the requests that reach it.
type countingTransport struct {
	next  http.RoundTripper
	calls atomic.Int32
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.calls.Add(1)
	return c.next.RoundTrip(r)
}

// An agent stops promptly while the API server is unreachable: client-go's
// watch-list waits out its backoff (0.8 s doubling to 30 s) without looking
// at the context, and the Node watch used to wait with it (a pod past its
// grace period is killed). The stop comes right after a failed call, when
// the backoff has just begun and is at least 3.2 s long (the fourth
// failure): the watch must not wait for it.
func TestStopWhileAPIServerUnreachable(t *testing.T) {
	// A port that refuses: a listener closed again.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	var transport *countingTransport
	cfg := &rest.Config{Host: "http://" + addr, WrapTransport: func(rt http.RoundTripper) http.RoundTripper {
		transport = &countingTransport{next: rt}
		return transport
	}}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h, log := startNodeWatch(t, &kubeclient.Client{CoreV1: cs.CoreV1().RESTClient(), NodeName: "node-s1"})
	// The fourth call fails: its backoff is 3.2 s (jittered upwards).
	deadline := time.Now().Add(30 * time.Second)
	for transport == nil || transport.calls.Load() < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("the Node watch called the API server %d times in 30 s, want 4", transport.calls.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	start := time.Now()
	if err := h.Stop(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("the agent took %v to stop while the API server was unreachable; want it not to wait out client-go's backoff", took.Round(time.Millisecond))
	}
}
