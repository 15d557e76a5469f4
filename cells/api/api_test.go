package api_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/cells/api"
	"github.com/ipmasq/ipmasq/cells/config"
	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/cells/podcidrs"
	"github.com/ipmasq/ipmasq/internal/kubeclient"
	"github.com/ipmasq/ipmasq/internal/unixsock"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/settings"
)

// node is an agent with the config, IPAM and API cells only (no kernel
// objects), on a private directory.
type node struct {
	t      testing.TB
	dir    string
	socket string
	config string
	pools  []string
	h      *hive.Hive
	client *ipamapi.Client
	// ipam is the node's IPAM, for in-process baselines.
	ipam *ipam.IPAM
}

func newNode(t testing.TB, args ...string) *node {
	return newNodeWithPools(t, []string{"10.244.1.0/24", "fd00:10:244:1::/64"}, args...)
}

func newNodeWithPools(t testing.TB, pools []string, args ...string) *node {
	return newNodeWithConfig(t, "", pools, args...)
}

// newNodeWithConfig starts a node whose config file (when not empty) is in
// place before the agent starts, as on a real node: answers carry it at once.
func newNodeWithConfig(t testing.TB, config string, pools []string, args ...string) *node {
	dir := t.TempDir()
	n := &node{t: t, dir: dir, socket: filepath.Join(dir, "api.sock"), config: filepath.Join(dir, "config", "ip-masq-agent"), pools: pools}
	if config != "" {
		n.writeConfig(config)
	}
	n.start(args...)
	return n
}

func (n *node) start(args ...string) {
	n.build(args...)
	log := hivetest.Logger(n.t, hivetest.LogLevel(slog.LevelWarn))
	if err := n.h.Start(log, context.Background()); err != nil {
		n.t.Fatal(err)
	}
	h := n.h
	n.t.Cleanup(func() { h.Stop(log, context.Background()) })
}

// build makes the node's hive, with its flags, and its client; it does not
// start it.
func (n *node) build(args ...string) {
	n.h = hive.NewWithOptions(agent.Options(),
		agent.Infrastructure, settings.Cell, kubeclient.Cell, config.Cell, podcidrs.Cell, ipam.Cell, api.Cell,
		cell.Invoke(func(i *ipam.IPAM) { n.ipam = i }))
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	n.h.RegisterFlags(flags)
	all := append([]string{
		"--ip-masq-agent-config-path=" + n.config,
		"--state-dir=" + filepath.Join(n.dir, "state"),
		"--api-socket=" + n.socket,
		"--enable-ipv6", // off by default; the tests allocate both families
	}, args...)
	for _, p := range n.pools {
		all = append(all, "--pod-cidr="+p)
	}
	if err := flags.Parse(all); err != nil {
		n.t.Fatal(err)
	}
	n.client = ipamapi.NewClient(n.socket)
}

func (n *node) stop() {
	if err := n.h.Stop(hivetest.Logger(n.t), context.Background()); err != nil {
		n.t.Fatal(err)
	}
}

func (n *node) writeConfig(content string) {
	if err := os.MkdirAll(filepath.Dir(n.config), 0o755); err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(n.config+".tmp", []byte(content), 0o644); err != nil {
		n.t.Fatal(err)
	}
	if err := os.Rename(n.config+".tmp", n.config); err != nil {
		n.t.Fatal(err)
	}
}

// raw sends a request with an arbitrary body and returns status and body.
func (n *node) raw(method, path, body string) (int, string) {
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", n.socket)
	}}}
	req, _ := http.NewRequest(method, "http://ipmasq"+path, strings.NewReader(body))
	resp, err := c.Do(req)
	if err != nil {
		n.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func apiStatus(err error) int {
	var e *ipamapi.Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}

func TestAllocateIdempotentAndCIDRs(t *testing.T) {
	n := newNodeWithConfig(t, "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n", []string{"10.244.1.0/24", "fd00:10:244:1::/64"})
	ctx := context.Background()
	status, body := n.raw("POST", "/v1/ipam/allocations", `{"owner":"c1/eth0","family":"ipv4","routeTable":11}`)
	if status != http.StatusCreated || !strings.Contains(body, `"ip":"10.244.1.2"`) ||
		!strings.Contains(body, `"nonMasqueradeCIDRs":["10.0.0.0/8","169.254.0.0/16"]`) || !strings.Contains(body, `"routeTable":11`) {
		t.Fatalf("first allocation: %d %s", status, body)
	}
	status, body = n.raw("POST", "/v1/ipam/allocations", `{"owner":"c1/eth0","family":"ipv4","routeTable":11}`)
	if status != http.StatusOK || !strings.Contains(body, `"ip":"10.244.1.2"`) {
		t.Fatalf("repeated allocation must return the same address with 200: %d %s", status, body)
	}
	// The same owner may hold one address per family.
	a6, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "c1/eth0", Family: "ipv6"})
	if err != nil || a6.IP.String() != "fd00:10:244:1::2" || fmt.Sprint(a6.NonMasqueradeCIDRs) != "[fd00::/8 fe80::/10]" {
		t.Fatalf("ipv6 allocation: %+v %v", a6, err)
	}
	// A different route table for the same owner is a conflict.
	if _, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "c1/eth0", Family: "ipv4"}); apiStatus(err) != http.StatusConflict {
		t.Fatalf("conflicting route table: want 409, got %v", err)
	}
	fi, err := os.Stat(n.socket)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v %v", fi.Mode(), err)
	}
}

func TestBadRequests(t *testing.T) {
	n := newNode(t)
	for _, tc := range []struct {
		name, method, path, body string
		status                   int
		msg                      string
	}{
		{"bad JSON", "POST", "/v1/ipam/allocations", `{"owner":`, 400, "bad JSON"},
		{"unknown field", "POST", "/v1/ipam/allocations", `{"owner":"a","family":"ipv4","rt":1}`, 400, `unknown field \"rt\"`},
		{"bad family", "POST", "/v1/ipam/allocations", `{"owner":"a","family":"inet"}`, 400, `family \"inet\"`},
		{"missing owner", "POST", "/v1/ipam/allocations", `{"family":"ipv4"}`, 400, "owner is empty"},
		{"trailing data", "POST", "/v1/ipam/allocations", `{"owner":"a","family":"ipv4"} {}`, 400, "data after the object"},
		{"oversized body", "POST", "/v1/ipam/allocations", `{"owner":"` + strings.Repeat("x", api.MaxRequestBody) + `"}`, 413, "over"},
		{"bad IP", "DELETE", "/v1/ipam/allocations/10.0.0", "", 400, "not an IP"},
		{"unknown IP", "DELETE", "/v1/ipam/allocations/10.244.1.77", "", 404, "no such allocation"},
		{"delete without owner", "DELETE", "/v1/ipam/allocations", "", 400, "owner"},
		{"unknown path", "GET", "/v1/nope", "", 404, "no such endpoint"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, body := n.raw(tc.method, tc.path, tc.body)
			if status != tc.status || !strings.Contains(body, `"error":`) || !strings.Contains(body, tc.msg) {
				t.Fatalf("got %d %s, want %d with %q", status, body, tc.status, tc.msg)
			}
		})
	}
}

func TestExhaustionAndRelease(t *testing.T) {
	// A /29 has five usable addresses: .0 is the network, .1 the gateway,
	// .7 the broadcast address.
	n := newNodeWithPools(t, []string{"10.250.0.0/29"})
	ctx := context.Background()
	c := n.client
	var allocs []ipamapi.AllocationResponse
	for _, owner := range []string{"a", "b", "x1", "x2", "x3"} {
		a, err := c.Allocate(ctx, ipamapi.AllocationRequest{Owner: owner, Family: "ipv4"})
		if err != nil {
			t.Fatalf("allocate %s: %v", owner, err)
		}
		allocs = append(allocs, a)
	}
	if got := allocs[0].IP.String(); got != "10.250.0.2" {
		t.Fatalf("first allocation %s, want 10.250.0.2 (.1 is the gateway)", got)
	}
	a := allocs[0]
	_, err3 := c.Allocate(ctx, ipamapi.AllocationRequest{Owner: "c", Family: "ipv4"})
	if apiStatus(err3) != http.StatusConflict || !strings.Contains(err3.Error(), "exhausted") {
		t.Fatalf("exhaustion: %v", err3)
	}
	if _, err := c.Allocate(ctx, ipamapi.AllocationRequest{Owner: "d", Family: "ipv6"}); apiStatus(err) != http.StatusBadRequest || !strings.Contains(err.Error(), "no pool for ipv6") {
		t.Fatalf("no ipv6 pool: %v", err)
	}
	if err := c.Release(ctx, a.IP); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(ctx, a.IP); apiStatus(err) != http.StatusNotFound {
		t.Fatalf("second release: want 404, got %v", err)
	}
	if _, err := c.Allocate(ctx, ipamapi.AllocationRequest{Owner: "c", Family: "ipv4"}); err != nil {
		t.Fatalf("allocation after release: %v", err)
	}
	for _, owner := range []string{"b", "x1", "x2", "x3"} {
		if err := c.ReleaseOwner(ctx, owner); err != nil {
			t.Fatal(err)
		}
	}
	list, _ := c.List(ctx)
	if len(list) != 1 || list[0].Owner != "c" {
		t.Fatalf("list after releases: %+v", list)
	}
}

func TestConcurrentAllocations(t *testing.T) {
	n := newNode(t)
	ctx := context.Background()
	const workers = 200
	var wg sync.WaitGroup
	ips := make([]string, workers)
	errs := make([]error, workers)
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := fmt.Sprintf("pod-%d", i%150) // some owners ask twice
			a, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: owner, Family: "ipv4"})
			ips[i], errs[i] = a.IP.String()+" "+owner, err
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	byIP := map[string]string{}
	for _, s := range ips {
		ip, owner, _ := strings.Cut(s, " ")
		if prev, ok := byIP[ip]; ok && prev != owner {
			t.Fatalf("address %s handed to %s and %s", ip, prev, owner)
		}
		byIP[ip] = owner
	}
	list, err := n.client.List(ctx)
	if err != nil || len(list) != 150 || len(byIP) != 150 {
		t.Fatalf("want 150 distinct allocations, list has %d, answers %d (%v)", len(list), len(byIP), err)
	}
}

func TestWaitsForFirstConfigLoad(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config", "ip-masq-agent")
	os.MkdirAll(filepath.Dir(cfg), 0o755)
	// An invalid first file: the table stays uninitialized.
	os.WriteFile(cfg, []byte("nonMasqueradeCIDRs: [10.0.0.1/8]\n"), 0o644)
	n := &node{t: t, dir: dir, socket: filepath.Join(dir, "api.sock"), config: cfg, pools: []string{"10.244.1.0/24"}}
	n.start("--ipam-config-wait=300ms")
	ctx := context.Background()

	start := time.Now()
	_, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "early", Family: "ipv4"})
	if apiStatus(err) != http.StatusServiceUnavailable || !strings.Contains(err.Error(), "not been loaded") {
		t.Fatalf("before the first load: want 503, got %v", err)
	}
	if time.Since(start) < 300*time.Millisecond {
		t.Fatalf("answered after %v, before --ipam-config-wait", time.Since(start))
	}
	list, _ := n.client.List(ctx)
	if len(list) != 0 {
		t.Fatalf("a refused request must not allocate: %+v", list)
	}

	// A request that is waiting when the good file arrives gets its CIDRs.
	go func() {
		time.Sleep(100 * time.Millisecond)
		n.writeConfig("nonMasqueradeCIDRs: [192.168.0.0/16]\nmasqLinkLocal: true\n")
	}()
	a, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "early", Family: "ipv4"})
	if err != nil || fmt.Sprint(a.NonMasqueradeCIDRs) != "[192.168.0.0/16]" {
		t.Fatalf("after the first load: %+v %v", a, err)
	}
}

func TestRestartRestoresAllocations(t *testing.T) {
	n := newNode(t)
	ctx := context.Background()
	var want []string
	for i := range 5 {
		a, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: fmt.Sprintf("p%d", i), Family: "ipv4", RouteTable: ptr(uint32(10 + i))})
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, fmt.Sprintf("%s %s %d", a.IP, a.Owner, a.RouteTable))
	}
	n.stop()
	n.start()
	list, err := n.client.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, a := range list {
		got = append(got, fmt.Sprintf("%s %s %d", a.IP, a.Owner, a.RouteTable))
	}
	sort.Strings(got)
	sort.Strings(want)
	if !slices.Equal(got, want) {
		t.Fatalf("after restart: %v, want %v", got, want)
	}
	again, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "p3", Family: "ipv4", RouteTable: ptr(uint32(13))})
	if err != nil || again.IP.String() != strings.Fields(want[3])[0] {
		t.Fatalf("p3 after restart: %+v %v", again, err)
	}
}

func ptr[T any](v T) *T { return &v }

// TestClientAnswersOutliveTheNext: the client reads answers into buffers it
// reuses; what one answer decoded stays as it was after the next answers
// (other owners, other families, an error) were read into the same buffer.
func TestClientAnswersOutliveTheNext(t *testing.T) {
	n := newNodeWithConfig(t, "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n", []string{"10.244.1.0/24", "fd00:10:244:1::/64"})
	ctx := context.Background()
	// The longest answer first: the next ones fit in its buffer.
	first, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "a-much-longer-owner-name/eth0", Family: "ipv6"})
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%+v", first)
	for i, req := range []ipamapi.AllocationRequest{
		{Owner: "c1/eth0", Family: "ipv4"},
		{Owner: "c2/eth0", Family: "ipv6"},
		{Owner: "", Family: "ipv4"}, // 400
	} {
		if _, err := n.client.Allocate(ctx, req); err != nil && i < 2 {
			t.Fatal(err)
		}
		if got := fmt.Sprintf("%+v", first); got != want {
			t.Fatalf("after answer %d the first answer changed:\n%s\nwas\n%s", i+1, got, want)
		}
	}
}

// TestSocketDirectoryRemovedStopsTheAgent: the API socket's directory
// removed as a whole while the agent reaches it through a bind mount (a
// hostPath volume after `rm -rf /run/ipmasq` on the node) can never be
// reached by the CNI plugin again, however often the agent binds: the
// agent stops with an error that says so, and the kubelet's restart brings
// the directory back (testkit/nodee2e TestFleet checks that part
// on a real node). The bind mount's view is made by a /proc/self/fd link.
func TestSocketDirectoryRemovedStopsTheAgent(t *testing.T) {
	dir := t.TempDir()
	run := filepath.Join(dir, "run")
	if err := os.Mkdir(run, 0o700); err != nil {
		t.Fatal(err)
	}
	d, err := os.Open(run)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	n := &node{t: t, dir: dir, socket: fmt.Sprintf("/proc/self/fd/%d/api.sock", d.Fd()),
		config: filepath.Join(dir, "config", "ip-masq-agent"), pools: []string{"10.244.1.0/24"}}
	n.build()
	done := make(chan error, 1)
	go func() { done <- n.h.Run(hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn))) }()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		if _, err := n.client.List(ctx); err == nil {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("the agent stopped before it served: %v", err)
		case <-ctx.Done():
			t.Fatal("the API never answered")
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := os.RemoveAll(run); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, unixsock.ErrDirRemoved) {
			t.Fatalf("the agent stopped with %v, want ErrDirRemoved", err)
		}
	case <-ctx.Done():
		t.Fatal("the agent still runs with its socket's directory removed")
	}
}
