package metrics

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
)

// TestReadHealth pins the "health" command format ReadHealth parses: a
// hive upgrade that changes it fails here.
func TestReadHealth(t *testing.T) {
	_, root := cell.NewSimpleHealth()
	root.NewScope("config").NewScope("config-file").Degraded("config file rejected",
		errors.New("/etc/ip-masq-agent: nonMasqueradeCIDRs[0]: 10.0.0.1/8 has host bits set\nsecond line: level=x"))
	root.NewScope("ipam").OK("3 endpoints")
	root.NewScope("api").Stopped("done")
	root.NewScope("devices")

	got, err := ReadHealth(context.Background(), root)
	if err != nil {
		t.Fatal(err)
	}
	want := []ScopeHealth{
		{Scope: "api", Level: cell.StatusStopped, Message: "done"},
		{Scope: "config", Level: "", Message: ""},
		{Scope: "config.config-file", Level: cell.StatusDegraded, Message: "config file rejected",
			Error: "/etc/ip-masq-agent: nonMasqueradeCIDRs[0]: 10.0.0.1/8 has host bits set\nsecond line: level=x"},
		{Scope: "devices", Level: "", Message: ""},
		{Scope: "ipam", Level: cell.StatusOK, Message: "3 endpoints"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("ReadHealth:\n got %q\nwant %q", got, want)
	}
}

// TestReadHealthRoot: a hive without per-module scopes reports on the root.
func TestReadHealthRoot(t *testing.T) {
	h, root := cell.NewSimpleHealth()
	h.Degraded("broken", errors.New("boom"))
	got, err := ReadHealth(context.Background(), root)
	if err != nil {
		t.Fatal(err)
	}
	want := []ScopeHealth{{Scope: "(root)", Level: cell.StatusDegraded, Message: "broken", Error: "boom"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("ReadHealth: got %q, want %q", got, want)
	}
}

func TestHealthz(t *testing.T) {
	_, root := cell.NewSimpleHealth()
	file := root.NewScope("config").NewScope("config-file")
	file.OK("generation 1")
	root.NewScope("ipam").OK("ready")
	s := &Server{health: root, mux: http.NewServeMux()}
	get := func(path string) (int, string) {
		t.Helper()
		rec := httptest.NewRecorder()
		s.serveHealth(rec, httptest.NewRequest(http.MethodGet, path, nil))
		body, _ := io.ReadAll(rec.Body)
		return rec.Code, string(body)
	}

	if code, body := get("/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("healthy: %d %q", code, body)
	}
	file.Degraded("config file rejected, last good config kept", errors.New("nonMasqueradeCIDRs[0]: bad"))
	code, body := get("/healthz")
	if code != http.StatusServiceUnavailable {
		t.Fatalf("degraded: status %d, want 503", code)
	}
	if want := "degraded: 1 of 3 health scopes\nconfig.config-file: Degraded: config file rejected, last good config kept: nonMasqueradeCIDRs[0]: bad\n"; body != want {
		t.Fatalf("degraded body:\n%s\nwant:\n%s", body, want)
	}
	if _, body := get("/healthz?verbose"); !strings.Contains(body, "all scopes with a status:\n") || !strings.Contains(body, "ipam: OK: ready\n") {
		t.Fatalf("verbose body lacks every scope:\n%s", body)
	} else if strings.Contains(body, "config: ") {
		t.Fatalf("verbose body lists the scope config, which has no status:\n%s", body)
	}
	file.OK("generation 2")
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Fatalf("healthy again: %d", code)
	}

	s.health = nil
	if code, _ := get("/healthz"); code != http.StatusNotImplemented {
		t.Fatalf("no SimpleHealth: %d, want 501", code)
	}
}

// TestHealthCmd: without a pattern the command prints only the scopes that
// reported a status, sorted, without empty "level= message= error=" lines;
// with a pattern it still matches hive's line format (script tests grep it).
func TestHealthCmd(t *testing.T) {
	_, root := cell.NewSimpleHealth()
	root.NewScope("config").NewScope("config-file").Degraded("config file rejected", errors.New("bad CIDR"))
	root.NewScope("ipam").OK("3 endpoints")
	root.NewScope("devices")

	run := func(args ...string) (string, error) {
		s, err := script.NewState(context.Background(), "/", nil)
		if err != nil {
			t.Fatal(err)
		}
		wait, err := HealthCmd(root).Run(s, args...)
		if err != nil || wait == nil {
			return "", err
		}
		out, _, err := wait(s)
		return out, err
	}
	got, err := run()
	if err != nil {
		t.Fatal(err)
	}
	want := "config.config-file: Degraded: config file rejected: bad CIDR\nipam: OK: 3 endpoints\n"
	if got != want {
		t.Fatalf("health:\n%s\nwant:\n%s", got, want)
	}
	if _, err := run("ipam: level=OK message=3 endpoints"); err != nil {
		t.Fatalf("health with a pattern: %v", err)
	}
}
