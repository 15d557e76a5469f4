package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ipmasq/ipmasq/ipamapi"
)

// fakeAgent serves the IPAM API on a unix socket from memory: addresses
// 10.244.1.1… and fd00:244::1… in order, one per owner and family.
type fakeAgent struct {
	socket string

	mu       sync.Mutex
	allocs   []ipamapi.AllocationResponse
	requests []ipamapi.AllocationRequest
	next4    netip.Addr
	next6    netip.Addr
	noIPv6   bool // answer IPv6 requests like an agent without an IPv6 pool
	status   int  // when set, every request fails with it
}

func newFakeAgent(t *testing.T) *fakeAgent {
	t.Helper()
	f := &fakeAgent{
		socket: filepath.Join(t.TempDir(), "api.sock"),
		next4:  netip.MustParseAddr("10.244.1.2"),
		next6:  netip.MustParseAddr("fd00:244::2"),
	}
	l, err := net.Listen("unix", f.socket)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/ipam/allocations", f.allocate)
	mux.HandleFunc("GET /v1/ipam/allocations", f.list)
	mux.HandleFunc("DELETE /v1/ipam/allocations", f.releaseOwner)
	srv := &http.Server{Handler: mux}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return f
}

func (f *fakeAgent) fail(w http.ResponseWriter) bool {
	if f.status == 0 {
		return false
	}
	writeJSON(w, f.status, ipamapi.ErrorResponse{Error: "fake failure"})
	return true
}

func (f *fakeAgent) allocate(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail(w) {
		return
	}
	var req ipamapi.AllocationRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		writeJSON(w, http.StatusBadRequest, ipamapi.ErrorResponse{Error: err.Error()})
		return
	}
	f.requests = append(f.requests, req)
	if req.Family == "ipv6" && f.noIPv6 {
		writeJSON(w, http.StatusBadRequest, ipamapi.ErrorResponse{Error: "no pool: no ipv6 --pod-cidr"})
		return
	}
	for _, a := range f.allocs {
		if a.Owner == req.Owner && a.IP.Is6() == (req.Family == "ipv6") {
			writeJSON(w, http.StatusOK, a)
			return
		}
	}
	a := ipamapi.AllocationResponse{Owner: req.Owner, RouteTable: 11}
	if req.RouteTable != nil {
		a.RouteTable = *req.RouteTable
	}
	if req.Family == "ipv6" {
		a.IP, f.next6, a.Pool = f.next6, f.next6.Next(), "fd00:244::/64"
	} else {
		a.IP, f.next4, a.Pool = f.next4, f.next4.Next(), "10.244.1.0/24"
	}
	f.allocs = append(f.allocs, a)
	writeJSON(w, http.StatusCreated, a)
}

func (f *fakeAgent) list(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail(w) {
		return
	}
	writeJSON(w, http.StatusOK, ipamapi.ListResponse{Allocations: append([]ipamapi.AllocationResponse{}, f.allocs...)})
}

func (f *fakeAgent) releaseOwner(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail(w) {
		return
	}
	owner := r.URL.Query().Get("owner")
	n := len(f.allocs)
	f.allocs = slicesDelete(f.allocs, func(a ipamapi.AllocationResponse) bool { return a.Owner == owner })
	if len(f.allocs) == n {
		writeJSON(w, http.StatusNotFound, ipamapi.ErrorResponse{Error: "not found: owner " + owner})
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func slicesDelete(s []ipamapi.AllocationResponse, del func(ipamapi.AllocationResponse) bool) []ipamapi.AllocationResponse {
	var out []ipamapi.AllocationResponse
	for _, a := range s {
		if !del(a) {
			out = append(out, a)
		}
	}
	return out
}

func (f *fakeAgent) owners() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, a := range f.allocs {
		out = append(out, a.Owner+" "+a.IP.String())
	}
	return out
}

func (f *fakeAgent) add(owner string, ip string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.allocs = append(f.allocs, ipamapi.AllocationResponse{Owner: owner, IP: netip.MustParseAddr(ip)})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// conf is a network configuration with the ipam object given.
func conf(ipam string) []byte {
	return []byte(`{"cniVersion":"1.1.0","name":"pods","type":"ptp","ipam":` + ipam + `}`)
}

func ipamFor(socket string, extra string) string {
	return fmt.Sprintf(`{"type":"ipmasq-cni","socketPath":%q,"podCIDRs":["10.244.1.0/24","fd00:244::/64"]%s}`, socket, extra)
}

func cmdArgs(id string, stdin []byte) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: id, IfName: "eth0", Netns: "/var/run/netns/x", StdinData: stdin}
}

// add runs ADD and decodes the result it prints.
func add(t *testing.T, args *skel.CmdArgs) (*types100.Result, error) {
	t.Helper()
	out, err := captureStdout(t, func() error { return cmdAdd(args) })
	if err != nil {
		return nil, err
	}
	r := &types100.Result{}
	if err := json.Unmarshal(out, r); err != nil {
		t.Fatalf("ADD printed %q: %v", out, err)
	}
	return r, nil
}

func captureStdout(t *testing.T, fn func() error) ([]byte, error) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	done := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(r)
		done <- b
	}()
	err = fn()
	os.Stdout = stdout
	w.Close()
	return <-done, err
}

func TestAddIPv4(t *testing.T) {
	f := newFakeAgent(t)
	r, err := add(t, cmdArgs("c0ffee", conf(ipamFor(f.socket, `,"routeTable":11`))))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.IPs) != 1 || r.IPs[0].Address.String() != "10.244.1.2/24" || r.IPs[0].Gateway.String() != "10.244.1.1" {
		t.Fatalf("IPs %v, want 10.244.1.2/24 via 10.244.1.1", r.IPs)
	}
	if len(r.Routes) != 1 || r.Routes[0].Dst.String() != "0.0.0.0/0" || r.Routes[0].GW.String() != "10.244.1.1" {
		t.Fatalf("routes %v, want 0.0.0.0/0 via 10.244.1.1", r.Routes)
	}
	if r.CNIVersion != "1.1.0" {
		t.Fatalf("result version %q, want the config's 1.1.0", r.CNIVersion)
	}
	req := f.requests[0]
	if req.Owner != "c0ffee/eth0" || req.Family != "ipv4" || req.RouteTable == nil || *req.RouteTable != 11 {
		t.Fatalf("request %+v, want owner c0ffee/eth0, ipv4, route table 11", req)
	}

	// ADD again (a runtime retry): the same address.
	r2, err := add(t, cmdArgs("c0ffee", conf(ipamFor(f.socket, `,"routeTable":11`))))
	if err != nil || r2.IPs[0].Address.String() != "10.244.1.2/24" {
		t.Fatalf("second ADD: %v %v", r2, err)
	}
}

// TestAddPoolFromAgent: the minimal config, without podCIDRs: the
// prefix length and gateway come from the pool the agent answers with.
func TestAddPoolFromAgent(t *testing.T) {
	f := newFakeAgent(t)
	minimal := fmt.Sprintf(`{"type":"ipmasq-cni","socketPath":%q,"ipv6":true}`, f.socket)
	r, err := add(t, cmdArgs("c0ffee", conf(minimal)))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.IPs) != 2 || r.IPs[0].Address.String() != "10.244.1.2/24" || r.IPs[0].Gateway.String() != "10.244.1.1" ||
		r.IPs[1].Address.String() != "fd00:244::2/64" {
		t.Fatalf("IPs %v", r.IPs)
	}
}

func TestAddDualStack(t *testing.T) {
	f := newFakeAgent(t)
	r, err := add(t, cmdArgs("c0ffee", conf(ipamFor(f.socket, `,"ipv6":true`))))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ip := range r.IPs {
		got = append(got, ip.Address.String()+" via "+ip.Gateway.String())
	}
	for _, rt := range r.Routes {
		got = append(got, "route "+rt.Dst.String()+" via "+rt.GW.String())
	}
	want := "10.244.1.2/24 via 10.244.1.1, fd00:244::2/64 via fe80::1, route 0.0.0.0/0 via 10.244.1.1, route ::/0 via fe80::1"
	if strings.Join(got, ", ") != want {
		t.Fatalf("result %s\nwant   %s", strings.Join(got, ", "), want)
	}
	if f.requests[0].RouteTable != nil {
		t.Fatalf("route table %d sent, want none (the agent's default)", *f.requests[0].RouteTable)
	}
}

// TestAddIPv6Fails: no IPv6 pool; the ADD fails saying so, and does not
// keep the IPv4 address.
func TestAddIPv6Fails(t *testing.T) {
	f := newFakeAgent(t)
	f.noIPv6 = true
	_, err := add(t, cmdArgs("c0ffee", conf(ipamFor(f.socket, `,"ipv6":true`))))
	e := cniError(t, err, types.ErrInvalidNetworkConfig)
	if !strings.Contains(e.Msg, "no ipv6 --pod-cidr") || !strings.Contains(e.Msg, "c0ffee/eth0") {
		t.Fatalf("error %q does not say what failed", e.Msg)
	}
	if o := f.owners(); len(o) != 0 {
		t.Fatalf("allocations left: %v", o)
	}
}

// TestAddPools: ADD needs a pod CIDR of each family it allocates, checked
// before anything is allocated, and one that holds the address it got.
func TestAddPools(t *testing.T) {
	f := newFakeAgent(t)
	noV6 := fmt.Sprintf(`{"type":"ipmasq-cni","socketPath":%q,"podCIDRs":["10.244.1.0/24"],"ipv6":true}`, f.socket)
	_, err := add(t, cmdArgs("c0ffee", conf(noV6)))
	if e := cniError(t, err, types.ErrInvalidNetworkConfig); !strings.Contains(e.Msg, "no ipv6 prefix") {
		t.Fatalf("error %q", e.Msg)
	}
	if len(f.requests) != 0 {
		t.Fatalf("allocated %v before checking the config", f.requests)
	}
	elsewhere := fmt.Sprintf(`{"type":"ipmasq-cni","socketPath":%q,"podCIDRs":["10.99.0.0/16"]}`, f.socket)
	_, err = add(t, cmdArgs("c0ffee", conf(elsewhere)))
	if e := cniError(t, err, types.ErrInvalidNetworkConfig); !strings.Contains(e.Msg, "10.244.1.2, which is in none of ipam.podCIDRs [10.99.0.0/16]") {
		t.Fatalf("error %q", e.Msg)
	}
	if o := f.owners(); len(o) != 0 {
		t.Fatalf("allocations left: %v", o)
	}
}

func TestDel(t *testing.T) {
	f := newFakeAgent(t)
	stdin := conf(ipamFor(f.socket, `,"ipv6":true`))
	if _, err := add(t, cmdArgs("c0ffee", stdin)); err != nil {
		t.Fatal(err)
	}
	f.add("other/eth0", "10.244.1.99")
	if err := cmdDel(cmdArgs("c0ffee", stdin)); err != nil {
		t.Fatal(err)
	}
	if o := f.owners(); len(o) != 1 || o[0] != "other/eth0 10.244.1.99" {
		t.Fatalf("allocations after DEL: %v", o)
	}
	// DEL is idempotent: the owner is already gone.
	if err := cmdDel(cmdArgs("c0ffee", stdin)); err != nil {
		t.Fatalf("second DEL: %v", err)
	}
	// And of something never added.
	if err := cmdDel(cmdArgs("never", stdin)); err != nil {
		t.Fatalf("DEL of an unknown container: %v", err)
	}
}

func TestCheck(t *testing.T) {
	f := newFakeAgent(t)
	stdin := conf(ipamFor(f.socket, ""))
	r, err := add(t, cmdArgs("c0ffee", stdin))
	if err != nil {
		t.Fatal(err)
	}
	if err := cmdCheck(cmdArgs("c0ffee", stdin)); err != nil {
		t.Fatalf("CHECK after ADD: %v", err)
	}
	// With the prevResult of the ADD.
	prev, _ := json.Marshal(r)
	withPrev := []byte(strings.TrimSuffix(string(stdin), "}") + `,"prevResult":` + string(prev) + `}`)
	if err := cmdCheck(cmdArgs("c0ffee", withPrev)); err != nil {
		t.Fatalf("CHECK with prevResult: %v", err)
	}

	// The runtime thinks it has another address.
	other := strings.Replace(string(withPrev), "10.244.1.2/24", "10.244.1.50/24", 1)
	e := cniError(t, cmdCheck(cmdArgs("c0ffee", []byte(other))), types.ErrUnknownContainer)
	if !strings.Contains(e.Msg, "10.244.1.50") {
		t.Fatalf("error %q does not name the address", e.Msg)
	}
	// No IPv6 address although the config asks for one.
	cniError(t, cmdCheck(cmdArgs("c0ffee", conf(ipamFor(f.socket, `,"ipv6":true`)))), types.ErrUnknownContainer)
	// Released behind the runtime's back.
	if err := cmdDel(cmdArgs("c0ffee", stdin)); err != nil {
		t.Fatal(err)
	}
	e = cniError(t, cmdCheck(cmdArgs("c0ffee", stdin)), types.ErrUnknownContainer)
	if !strings.Contains(e.Msg, "c0ffee/eth0") || !strings.Contains(e.Msg, f.socket) {
		t.Fatalf("error %q should name the owner and the socket", e.Msg)
	}
}

// TestGC: only owners shaped like the plugin's and not valid are released.
func TestGC(t *testing.T) {
	f := newFakeAgent(t)
	f.add("keep/eth0", "10.244.1.10")
	f.add("keep/eth1", "10.244.1.11")
	f.add("stale/eth0", "10.244.1.12")
	f.add("stale/eth0", "fd00:244::12")
	f.add("manual", "10.244.1.13")     // not the plugin's shape
	f.add("a/b/c", "10.244.1.14")      // nor this
	f.add("vm-7/tap 0", "10.244.1.15") // an ifname with a space cannot be the plugin's
	stdin := `{"cniVersion":"1.1.0","name":"pods","type":"ptp","ipam":` + ipamFor(f.socket, "") +
		`,"cni.dev/valid-attachments":[{"containerID":"keep","ifname":"eth0"},{"containerID":"keep","ifname":"eth1"}]}`
	if err := cmdGC(&skel.CmdArgs{StdinData: []byte(stdin)}); err != nil {
		t.Fatal(err)
	}
	want := "keep/eth0 10.244.1.10, keep/eth1 10.244.1.11, manual 10.244.1.13, a/b/c 10.244.1.14, vm-7/tap 0 10.244.1.15"
	if got := strings.Join(f.owners(), ", "); got != want {
		t.Fatalf("after GC: %s\nwant      %s", got, want)
	}
}

func TestStatus(t *testing.T) {
	f := newFakeAgent(t)
	if err := cmdStatus(&skel.CmdArgs{StdinData: conf(ipamFor(f.socket, ""))}); err != nil {
		t.Fatal(err)
	}
	dead := filepath.Join(t.TempDir(), "api.sock")
	e := cniError(t, cmdStatus(&skel.CmdArgs{StdinData: conf(ipamFor(dead, ""))}), types.ErrPluginNotAvailable)
	if !strings.Contains(e.Msg, dead) {
		t.Fatalf("error %q does not name the socket", e.Msg)
	}
}

// TestDeadAgent: no socket, or a socket nobody serves: every command but
// DEL says which socket and "try again later" (DEL: TestDelWithoutAgent).
func TestDeadAgent(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "api.sock")
	refusing := filepath.Join(t.TempDir(), "api.sock")
	l, err := net.Listen("unix", refusing)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()

	for _, socket := range []string{missing, refusing} {
		stdin := conf(ipamFor(socket, fmt.Sprintf(`,"stateDir":%q`, t.TempDir())))
		for name, cmd := range map[string]func(*skel.CmdArgs) error{
			"ADD": cmdAdd, "CHECK": cmdCheck, "GC": cmdGC,
		} {
			_, err := captureStdout(t, func() error { return cmd(cmdArgs("c0ffee", stdin)) })
			e := cniError(t, err, types.ErrTryAgainLater)
			if !strings.Contains(e.Msg, socket) || !strings.Contains(e.Msg, "unreachable") {
				t.Errorf("%s with %s: error %q should name the socket and say it is unreachable", name, socket, e.Msg)
			}
		}
	}
}

// TestDelWithoutAgent: a DEL that cannot reach the agent succeeds, so the
// pod never sticks in Terminating: with an agent's state directory (its
// lock file there) it records the release for the agent, again on a retry;
// without one (never installed, or uninstalled) there is nothing to
// release and it writes nothing; only a record that cannot be written is
// "try again later".
func TestDelWithoutAgent(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "api.sock")
	state := t.TempDir()
	if err := os.WriteFile(filepath.Join(state, ipamapi.AgentLockName), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	stdin := conf(ipamFor(missing, fmt.Sprintf(`,"stateDir":%q`, state)))
	for range 2 {
		if err := cmdDel(cmdArgs("c0ffee", stdin)); err != nil {
			t.Fatalf("DEL with the agent down: %v", err)
		}
	}
	recs, err := ipamapi.PendingReleases(state)
	if err != nil || len(recs) != 1 || recs[0].Owner != "c0ffee/eth0" {
		t.Fatalf("pending releases: %+v, %v; want one for c0ffee/eth0", recs, err)
	}

	gone := filepath.Join(t.TempDir(), "uninstalled")
	if err := cmdDel(cmdArgs("c0ffee", conf(ipamFor(missing, fmt.Sprintf(`,"stateDir":%q`, gone))))); err != nil {
		t.Fatalf("DEL after an uninstall: %v", err)
	}
	if _, err := os.Lstat(gone); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("DEL after an uninstall made %s: %v", gone, err)
	}

	// The record cannot be written: the runtime is told to retry.
	blocked := t.TempDir()
	os.WriteFile(filepath.Join(blocked, ipamapi.AgentLockName), nil, 0o600)
	os.WriteFile(ipamapi.PendingReleaseDir(blocked), []byte("a file where the directory goes"), 0o600)
	e := cniError(t, cmdDel(cmdArgs("c0ffee", conf(ipamFor(missing, fmt.Sprintf(`,"stateDir":%q`, blocked))))), types.ErrTryAgainLater)
	if !strings.Contains(e.Msg, "unreachable") || !strings.Contains(e.Msg, "recording the release for later also failed") {
		t.Fatalf("DEL that can neither reach the agent nor record: %q", e.Msg)
	}
}

// TestAgentNotReady: 503 (no config loaded yet) is "try again later" too.
func TestAgentNotReady(t *testing.T) {
	f := newFakeAgent(t)
	f.status = http.StatusServiceUnavailable
	_, err := add(t, cmdArgs("c0ffee", conf(ipamFor(f.socket, ""))))
	e := cniError(t, err, types.ErrTryAgainLater)
	if !strings.Contains(e.Msg, "fake failure") {
		t.Fatalf("error %q does not carry the agent's answer", e.Msg)
	}
	// A DEL that the agent cannot do is an error, not a silent success.
	cniError(t, cmdDel(cmdArgs("c0ffee", conf(ipamFor(f.socket, "")))), types.ErrTryAgainLater)
}

func TestConfig(t *testing.T) {
	c, err := parseConfig(conf(`{"type":"ipmasq-cni"}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.IPAM.SocketPath != ipamapi.DefaultSocket || c.IPAM.RouteTable != nil || c.IPAM.IPv6 {
		t.Fatalf("defaults: %+v", c.IPAM)
	}
	for _, bad := range []string{
		`{"type":"ipmasq-cni","routeTabel":11}`,
		`{"type":"ipmasq-cni","routeTable":-1}`,
		`{"type":"ipmasq-cni","ipv6":"yes"}`,
		`{"type":"ipmasq-cni","podCIDRs":["10.244.1/24"]}`,
	} {
		_, err := parseConfig(conf(bad))
		e := cniError(t, err, types.ErrInvalidNetworkConfig)
		if !strings.Contains(e.Msg, "accepted keys") {
			t.Errorf("%s: error %q does not say what is accepted", bad, e.Msg)
		}
	}
	_, err = parseConfig(conf(`{"type":"ipmasq-cni","podCIDRs":["10.244.1.7/24"]}`))
	if e := cniError(t, err, types.ErrInvalidNetworkConfig); !strings.Contains(e.Msg, "did you mean 10.244.1.0/24") {
		t.Fatalf("error %q", e.Msg)
	}
	cniError(t, func() error { _, err := parseConfig([]byte(`{"ipam":`)); return err }(), types.ErrDecodingFailure)
	cniError(t, func() error { _, err := parseConfig([]byte(`{"cniVersion":"1.1.0"}`)); return err }(), types.ErrInvalidNetworkConfig)
}

func cniError(t *testing.T, err error, code uint) *types.Error {
	t.Helper()
	var e *types.Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T), want a CNI error with code %d", err, err, code)
	}
	if e.Code != code {
		t.Fatalf("error code %d (%s), want %d", e.Code, e, code)
	}
	return e
}
