package api_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/ipamapi"
)

// The tests in this file treat the API socket as hostile ground: clients
// that send garbage, too much, too slowly, or all at once while the config
// changes under them. The server must answer each with an error it can
// explain, keep serving everyone else, and never hand out an address twice
// or an answer that mixes two configs.

// rawExchange writes payload on a fresh connection to the socket and reads
// one HTTP response (or the error that ended the connection).
func rawExchange(t *testing.T, socket string, payload []byte) (*http.Response, string, error) {
	t.Helper()
	c, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	// The server may answer and close before the payload is all written.
	go c.Write(payload)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b), nil
}

func request(method, path string, headers []string, body string) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: ipmasq\r\nConnection: close\r\n", method, path)
	for _, h := range headers {
		b.WriteString(h + "\r\n")
	}
	fmt.Fprintf(&b, "Content-Length: %d\r\n\r\n%s", len(body), body)
	return []byte(b.String())
}

// stillServes fails the test unless a normal allocation succeeds at once.
func (n *node) stillServes(t *testing.T, owner string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if _, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: owner, Family: "ipv4"}); err != nil {
		t.Fatalf("the server no longer serves: %v", err)
	}
}

// TestHostileMalformedRequests: every malformed request gets a 4xx. Those
// that reach the handlers get a JSON error naming the problem; those that
// net/http refuses before any handler runs (a request line that is not
// HTTP, headers over its limit) get its plain-text 4xx. Either way the
// server keeps serving, and nothing is allocated or released.
func TestHostileMalformedRequests(t *testing.T) {
	n := newNode(t)
	ctx := context.Background()
	held, err := n.client.Allocate(ctx, ipamapi.AllocationRequest{Owner: "resident", Family: "ipv4"})
	if err != nil {
		t.Fatal(err)
	}
	const alloc = "/v1/ipam/allocations"
	jsonCT := "Content-Type: application/json"
	for _, tc := range []struct {
		name    string
		payload []byte
		status  int
		// jsonErr: the body is {"error": ...} containing msg.
		jsonErr bool
		msg     string
	}{
		{"garbage request line", []byte("\x00\x01\x02\xff\xfe garbage\r\n\r\n"), 400, false, ""},
		{"garbage body", request("POST", alloc, []string{jsonCT}, "\x00\xff\xfe\x13\x37binary"), 400, true, "bad JSON"},
		// encoding/json turns invalid UTF-8 into U+FFFD: "\xff\xfe/eth0"
		// and "\xfe\xff/eth0" would be one owner, sharing one address.
		{"invalid UTF-8 in JSON string", request("POST", alloc, []string{jsonCT}, "{\"owner\":\"\xff\xfe/eth0\",\"family\":\"ipv4\"}"), 400, true, "not valid UTF-8"},
		{"invalid UTF-8 in path", request("DELETE", alloc+"/\xff\xfe", nil, ""), 400, true, ""},
		{"deeply nested JSON", request("POST", alloc, []string{jsonCT}, strings.Repeat("[", 30000)+strings.Repeat("]", 30000)), 400, true, "exceeded max depth"},
		{"nested object in owner", request("POST", alloc, []string{jsonCT}, `{"owner":{"a":{"b":[1,2,{"c":null}]}},"family":"ipv4"}`), 400, true, "bad JSON"},
		{"form body", request("POST", alloc, []string{"Content-Type: application/x-www-form-urlencoded"}, "owner=a&family=ipv4"), 400, true, "bad JSON"},
		{"multipart body", request("POST", alloc, []string{"Content-Type: multipart/form-data; boundary=x"}, "--x\r\nContent-Disposition: form-data; name=\"owner\"\r\n\r\na\r\n--x--\r\n"), 400, true, "bad JSON"},
		{"empty body", request("POST", alloc, []string{jsonCT}, ""), 400, true, "bad JSON"},
		{"JSON null", request("POST", alloc, []string{jsonCT}, "null"), 400, true, "family"},
		{"JSON array", request("POST", alloc, []string{jsonCT}, `[{"owner":"a","family":"ipv4"}]`), 400, true, "bad JSON"},
		{"negative route table", request("POST", alloc, []string{jsonCT}, `{"owner":"a","family":"ipv4","routeTable":-1}`), 400, true, "bad JSON"},
		{"route table over 32 bits", request("POST", alloc, []string{jsonCT}, `{"owner":"a","family":"ipv4","routeTable":4294967296}`), 400, true, "bad JSON"},
		{"PUT", request("PUT", alloc, []string{jsonCT}, `{"owner":"a","family":"ipv4"}`), 404, true, "no such endpoint"},
		{"PATCH on an address", request("PATCH", alloc+"/"+held.IP.String(), nil, ""), 404, true, "no such endpoint"},
		{"GET on an address", request("GET", alloc+"/"+held.IP.String(), nil, ""), 404, true, "no such endpoint"},
		{"made-up method", request("BREW", alloc, nil, ""), 404, true, "no such endpoint"},
		{"DELETE traversal, encoded", request("DELETE", alloc+"/..%2f..%2fetc%2fpasswd", nil, ""), 400, true, "not an IP"},
		{"DELETE traversal, encoded dots", request("DELETE", alloc+"/%2e%2e", nil, ""), 400, true, "not an IP"},
		{"DELETE owner with traversal", request("DELETE", alloc+"?owner=../../"+held.Owner, nil, ""), 404, true, "no such allocation"},
		{"DELETE address with zone", request("DELETE", alloc+"/fe80::1%25eth0", nil, ""), 404, true, "no such allocation"},
		{"huge header", request("GET", alloc, []string{"X-Big: " + strings.Repeat("a", 2<<20)}, ""), 431, false, ""},
		{"many headers", request("GET", alloc, slices.Repeat([]string{"X-Many: " + strings.Repeat("b", 1000)}, 2000), ""), 431, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body, err := rawExchange(t, n.socket, tc.payload)
			if err != nil {
				t.Fatalf("no answer: %v", err)
			}
			if resp.StatusCode != tc.status {
				t.Errorf("got %d %q, want %d", resp.StatusCode, body, tc.status)
			}
			if tc.jsonErr {
				var e ipamapi.ErrorResponse
				if !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") ||
					json.Unmarshal([]byte(body), &e) != nil || e.Error == "" || !strings.Contains(e.Error, tc.msg) {
					t.Errorf("want a JSON error containing %q, got %s %q", tc.msg, resp.Header.Get("Content-Type"), body)
				}
			}
			n.stillServes(t, "probe")
		})
	}

	// The dot-segment path never reaches a handler: the mux redirects to
	// the cleaned path (/etc/passwd), which is no endpoint.
	resp, body, err := rawExchange(t, n.socket, request("DELETE", alloc+"/../../../etc/passwd", nil, ""))
	if err != nil || (resp.StatusCode/100 != 3 && resp.StatusCode/100 != 4) || strings.HasPrefix(resp.Header.Get("Location"), alloc) {
		t.Errorf("DELETE with dot segments: %v %v %q", resp, err, body)
	}

	// A well-formed JSON body sent as text/plain is accepted: the server
	// does not look at Content-Type. Logged, not enforced.
	if resp, _, err := rawExchange(t, n.socket, request("POST", alloc, []string{"Content-Type: text/plain"}, `{"owner":"text-plain","family":"ipv4"}`)); err == nil {
		t.Logf("valid JSON with Content-Type text/plain: HTTP %d", resp.StatusCode)
	}

	list, err := n.client.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var owners []string
	for _, a := range list {
		owners = append(owners, a.Owner)
	}
	slices.Sort(owners)
	if want := []string{"probe", "resident", "text-plain"}; !slices.Equal(owners, want) {
		t.Fatalf("after the malformed requests the allocations are %q, want %q", owners, want)
	}
}

// TestHostileOversizedBody: a 10 MiB body is refused with 413 as soon as
// the limit is crossed, without the server reading it all.
func TestHostileOversizedBody(t *testing.T) {
	n := newNode(t)
	c, err := net.Dial("unix", n.socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const size = 10 << 20
	start := time.Now()
	c.SetDeadline(start.Add(10 * time.Second))
	var written atomic.Int64
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		head := fmt.Sprintf("POST /v1/ipam/allocations HTTP/1.1\r\nHost: ipmasq\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{\"owner\":\"", size)
		c.Write([]byte(head))
		chunk := []byte(strings.Repeat("x", 32<<10))
		for written.Load() < size {
			k, err := c.Write(chunk)
			written.Add(int64(k))
			if err != nil {
				return
			}
		}
	}()
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	elapsed := time.Since(start)
	if err != nil {
		t.Fatalf("no answer to a 10 MiB body: %v (after %v)", err, elapsed)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	readAtAnswer := written.Load()
	c.Close()
	<-writerDone
	t.Logf("10 MiB body: HTTP %d after %v, client had written %d KiB when the answer came", resp.StatusCode, elapsed, readAtAnswer>>10)
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(body), `"error":`) {
		t.Fatalf("got %d %q, want 413 with a JSON error", resp.StatusCode, body)
	}
	if elapsed > time.Second {
		t.Errorf("413 took %v, want well under a second", elapsed)
	}
	if readAtAnswer >= size {
		t.Errorf("the whole body (%d bytes) was consumed before the answer", readAtAnswer)
	}
	n.stillServes(t, "after-oversized")
}

// TestHostileSlowClients: 100 connections that send nothing, or their
// headers a byte at a time, do not keep anyone else waiting, and the server
// drops them once ReadHeaderTimeout (5 s) has passed.
func TestHostileSlowClients(t *testing.T) {
	n := newNode(t)
	const slow = 100
	head := "POST /v1/ipam/allocations HTTP/1.1\r\nHost: ipmasq\r\nContent-Type: application/json\r\nX-Slow: " + strings.Repeat("s", 200)
	ctx, stopTrickle := context.WithCancel(context.Background())
	defer stopTrickle()
	closedAfter := make([]time.Duration, slow)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range slow {
		c, err := net.Dial("unix", n.socket)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if i%2 == 1 {
			// Half of them trickle their headers, a byte every 100 ms.
			go func() {
				for j := 0; ctx.Err() == nil; j++ {
					if _, err := c.Write([]byte{head[j%len(head)]}); err != nil {
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.SetReadDeadline(start.Add(15 * time.Second))
			io.Copy(io.Discard, c) // returns when the server closes
			closedAfter[i] = time.Since(start)
		}()
	}

	// While they hang, normal clients are served at once.
	for i := range 10 {
		t0 := time.Now()
		n.stillServes(t, fmt.Sprintf("normal-%d", i))
		if d := time.Since(t0); d > time.Second {
			t.Fatalf("allocation %d took %v with %d slow connections open", i, d, slow)
		}
	}

	wg.Wait()
	stopTrickle()
	slices.Sort(closedAfter)
	t.Logf("slow connections closed by the server after %v (first) to %v (last)", closedAfter[0], closedAfter[slow-1])
	if closedAfter[0] < 4*time.Second {
		t.Errorf("a slow connection was closed after %v, before ReadHeaderTimeout", closedAfter[0])
	}
	if closedAfter[slow-1] > 8*time.Second {
		t.Errorf("a slow connection stayed open %v, past ReadHeaderTimeout (5 s)", closedAfter[slow-1])
	}
	n.stillServes(t, "after-slow")
}

// Two configs a storm alternates between, with the sets each must yield
// per family (link-local included as the config says).
const (
	stormConfigA = "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16, fd00::/8]\nmasqLinkLocal: false\nmasqLinkLocalIPv6: true\n"
	stormConfigB = "nonMasqueradeCIDRs: [172.16.0.0/12, 2001:db8::/32, 2001:db9::/32]\nmasqLinkLocal: true\nmasqLinkLocalIPv6: false\n"
)

var stormSets = map[string][]string{
	"A ipv4": {"10.0.0.0/8", "169.254.0.0/16", "192.168.0.0/16"},
	"A ipv6": {"fd00::/8"},
	"B ipv4": {"172.16.0.0/12"},
	"B ipv6": {"2001:db8::/32", "2001:db9::/32", "fe80::/10"},
}

// whichConfig names the config whose family set cidrs is, or "".
func whichConfig(family string, cidrs []netip.Prefix) string {
	var got []string
	for _, p := range cidrs {
		got = append(got, p.String())
	}
	slices.Sort(got)
	for _, cfg := range []string{"A", "B"} {
		if slices.Equal(got, stormSets[cfg+" "+family]) {
			return cfg
		}
	}
	return ""
}

type stormAnswer struct {
	owner, family string
	ip            netip.Addr
	cidrs         []netip.Prefix
	done          time.Time // when the answer was in
}

// storm runs allocations from distinct owners (every tenth repeated, both
// families) while the config file flips between A and B every few ms and
// a third of the owners are released as soon as they have an address.
// It checks every answer and the final list, then releases everything and
// closes its connections.
func storm(t *testing.T, n *node, round int) {
	const workers = 1000
	transport := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", n.socket)
		},
		MaxIdleConnsPerHost: 64,
	}
	defer transport.CloseIdleConnections()
	hc := &http.Client{Transport: transport, Timeout: 30 * time.Second}
	do := func(method, path, body string) (int, []byte, error) {
		req, _ := http.NewRequest(method, "http://ipmasq"+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, b, err
	}

	stopFlip := make(chan struct{})
	flipped := make(chan int)
	go func() {
		flips := 0
		defer func() { flipped <- flips }()
		for {
			select {
			case <-stopFlip:
				return
			case <-time.After(3 * time.Millisecond):
			}
			if flips%2 == 0 {
				n.writeConfig(stormConfigB)
			} else {
				n.writeConfig(stormConfigA)
			}
			flips++
		}
	}()

	var (
		mu       sync.Mutex
		answers  []stormAnswer
		released = map[string]time.Time{} // owner|family → when the release began
		errs     []string
	)
	fail := func(format string, args ...any) {
		mu.Lock()
		errs = append(errs, fmt.Sprintf(format, args...))
		mu.Unlock()
	}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			id := i
			if i%10 == 9 {
				id = i - 9 // a repeated owner, racing its first request
			}
			owner := fmt.Sprintf("r%d-pod-%d", round, id)
			family := []string{"ipv4", "ipv6"}[id%2]
			status, body, err := do("POST", "/v1/ipam/allocations", fmt.Sprintf(`{"owner":%q,"family":%q}`, owner, family))
			if err != nil || (status != 200 && status != 201) {
				fail("allocate %s %s: %d %s %v", owner, family, status, body, err)
				return
			}
			var a ipamapi.AllocationResponse
			if err := json.Unmarshal(body, &a); err != nil {
				fail("allocate %s: %v %s", owner, err, body)
				return
			}
			mu.Lock()
			answers = append(answers, stormAnswer{owner: owner, family: family, ip: a.IP, cidrs: a.NonMasqueradeCIDRs, done: time.Now()})
			mu.Unlock()
			if id%3 == 0 && i == id {
				mu.Lock()
				released[owner+"|"+family] = time.Now()
				mu.Unlock()
				status, body, err := do("DELETE", "/v1/ipam/allocations?owner="+owner, "")
				// 404: the repeated request of this owner came later
				// and the address it was given is already gone.
				if err != nil || (status != 204 && status != 404) {
					fail("release %s: %d %s %v", owner, status, body, err)
				}
			}
		}()
	}
	t0 := time.Now()
	close(start)
	wg.Wait()
	elapsed := time.Since(t0)
	close(stopFlip)
	flips := <-flipped
	for _, e := range errs {
		t.Error(e)
	}

	// Every answer carries exactly one config's set for its family.
	seen := map[string]int{}
	for _, a := range answers {
		cfg := whichConfig(a.family, a.cidrs)
		if cfg == "" {
			t.Errorf("%s %s (%s) was answered with %v: neither config A nor B", a.owner, a.family, a.ip, a.cidrs)
		}
		seen[cfg]++
	}

	// No address was held by two owners at once: when two owners got the
	// same address, one of them was released before the other's answer.
	byIP := map[netip.Addr][]stormAnswer{}
	for _, a := range answers {
		byIP[a.ip] = append(byIP[a.ip], a)
	}
	for ip, as := range byIP {
		for _, x := range as {
			for _, y := range as {
				if x.owner+x.family == y.owner+y.family {
					continue
				}
				rx, okx := released[x.owner+"|"+x.family]
				ry, oky := released[y.owner+"|"+y.family]
				if !(okx && rx.Before(y.done)) && !(oky && ry.Before(x.done)) {
					t.Errorf("%s was handed to %s and %s with neither released in between", ip, x.owner, y.owner)
				}
			}
		}
	}

	// The final list: one owner per address, one address per owner and
	// family, the set of one config.
	status, body, err := do("GET", "/v1/ipam/allocations", "")
	if err != nil || status != 200 {
		t.Fatalf("list: %d %v", status, err)
	}
	var list ipamapi.ListResponse
	if err := json.Unmarshal(body, &list); err != nil {
		t.Fatal(err)
	}
	ips := map[netip.Addr]string{}
	holders := map[string]netip.Addr{}
	kept := 0
	for _, a := range list.Allocations {
		if !strings.HasPrefix(a.Owner, fmt.Sprintf("r%d-", round)) {
			continue
		}
		kept++
		family := "ipv4"
		if a.IP.Is6() {
			family = "ipv6"
		}
		if prev, ok := ips[a.IP]; ok {
			t.Errorf("the list has %s twice: %s and %s", a.IP, prev, a.Owner)
		}
		ips[a.IP] = a.Owner
		if prev, ok := holders[a.Owner+"|"+family]; ok {
			t.Errorf("the list has two %s addresses for %s: %s and %s", family, a.Owner, prev, a.IP)
		}
		holders[a.Owner+"|"+family] = a.IP
		if whichConfig(family, a.NonMasqueradeCIDRs) == "" {
			t.Errorf("list entry %s %s has %v: neither config A nor B", a.Owner, a.IP, a.NonMasqueradeCIDRs)
		}
	}
	t.Logf("storm %d: %d allocations in %v, %d config writes, answers with config A %d, B %d; %d owners released, %d allocations left",
		round, len(answers), elapsed, flips, seen["A"], seen["B"], len(released), kept)

	// Clean up, so the next storm starts from the same state.
	for key := range holders {
		owner, _, _ := strings.Cut(key, "|")
		if status, _, err := do("DELETE", "/v1/ipam/allocations?owner="+owner, ""); err != nil || (status != 204 && status != 404) {
			t.Errorf("final release of %s: %d %v", owner, status, err)
		}
	}
	n.writeConfig(stormConfigA)
}

// settledGoroutines waits up to 3 s for the goroutine count to fall to
// limit, and returns the last count seen.
func settledGoroutines(limit int) int {
	var g int
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if g = runtime.NumGoroutine(); g <= limit {
			break
		}
	}
	return g
}

func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// TestHostileStorm: 1 000 concurrent allocations racing config reloads and
// releases, twice. Checks are in storm; here, that neither goroutines nor
// the heap grow from one storm to the next.
func TestHostileStorm(t *testing.T) {
	n := newNodeWithConfig(t, stormConfigA, []string{"10.200.0.0/16", "fd00:200::/64"})
	n.stillServes(t, "warm-up")
	time.Sleep(100 * time.Millisecond)
	baseline := runtime.NumGoroutine()

	storm(t, n, 1)
	g1 := settledGoroutines(baseline + 5)
	h1 := heapInUse()
	storm(t, n, 2)
	g2 := settledGoroutines(baseline + 5)
	h2 := heapInUse()

	t.Logf("goroutines: %d before, %d after storm 1, %d after storm 2; heap in use after GC: %d KiB after storm 1, %d KiB after storm 2",
		baseline, g1, g2, h1>>10, h2>>10)
	if g1 > baseline+5 || g2 > baseline+5 {
		t.Errorf("goroutines did not return to the baseline %d (+5): %d after storm 1, %d after storm 2", baseline, g1, g2)
	}
	if h2 > h1+h1/2+(4<<20) {
		t.Errorf("heap in use grew from %d KiB after storm 1 to %d KiB after storm 2", h1>>10, h2>>10)
	}
}
