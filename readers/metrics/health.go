package metrics

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
)

// ScopeHealth is the state of one health scope, e.g. "config.config-file".
type ScopeHealth struct {
	Scope   string
	Level   cell.Level
	Message string
	Error   string
}

// ReadHealth returns the state of every scope of h, sorted by scope.
//
// cell.SimpleHealth keeps its scopes in an unexported map; the one exported
// way to list them is the "health" script command, so this runs that
// command and parses its lines ("<scope>: level=<level> message=<message>
// error=<error>", the format script tests grep for). An error spanning
// several lines continues on the following lines. TestReadHealth pins the
// format, so a hive upgrade that changes it fails there, not in production.
func ReadHealth(ctx context.Context, h *cell.SimpleHealth) ([]ScopeHealth, error) {
	s, err := script.NewState(ctx, "/", []string{})
	if err != nil {
		return nil, err
	}
	if _, err := cell.SimpleHealthCmd(h).Run(s); err != nil {
		return nil, fmt.Errorf("health command: %w", err)
	}
	var out bytes.Buffer
	if err := s.CloseAndWait(&out); err != nil {
		return nil, fmt.Errorf("health command: %w", err)
	}
	scopes := parseHealth(out.String())

	// The root is not one of its own scopes; a hive without per-module
	// scopes reports on it directly.
	h.Lock()
	if h.Level != "" && h.Level != cell.StatusUnknown {
		root := ScopeHealth{Scope: "(root)", Level: h.Level, Message: h.Status}
		if h.Error != nil {
			root.Error = h.Error.Error()
		}
		scopes = append(scopes, root)
	}
	h.Unlock()

	slices.SortFunc(scopes, func(a, b ScopeHealth) int { return strings.Compare(a.Scope, b.Scope) })
	return scopes, nil
}

func parseHealth(text string) []ScopeHealth {
	var scopes []ScopeHealth
	for line := range strings.Lines(text) {
		line = strings.TrimSuffix(line, "\n")
		scope, rest, ok := strings.Cut(line, ": level=")
		if !ok || len(scopes) > 0 && strings.Contains(scope, " ") {
			// The continuation of a multi-line error.
			if n := len(scopes); n > 0 {
				scopes[n-1].Error += "\n" + line
			}
			continue
		}
		level, rest, _ := strings.Cut(rest, " message=")
		message, errStr, _ := strings.Cut(rest, " error=")
		scopes = append(scopes, ScopeHealth{Scope: scope, Level: cell.Level(level), Message: message, Error: errStr})
	}
	return scopes
}

// serveHealth answers 200 when no scope is degraded and 503 with the
// degraded scopes otherwise. ?verbose lists every scope.
func (s *Server) serveHealth(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if s.health == nil {
		http.Error(w, "health is not tracked: the hive has no cell.SimpleHealth", http.StatusNotImplemented)
		return
	}
	scopes, err := ReadHealth(r.Context(), s.health)
	if err != nil {
		http.Error(w, "read health: "+err.Error(), http.StatusInternalServerError)
		return
	}
	var degraded []ScopeHealth
	for _, sc := range scopes {
		if sc.Level == cell.StatusDegraded {
			degraded = append(degraded, sc)
		}
	}
	var b strings.Builder
	if len(degraded) == 0 {
		b.WriteString("ok\n")
	} else {
		fmt.Fprintf(&b, "degraded: %d of %d health scopes\n", len(degraded), len(scopes))
		for _, sc := range degraded {
			writeScope(&b, sc)
		}
	}
	if _, verbose := r.URL.Query()["verbose"]; verbose {
		b.WriteString("\nall scopes with a status:\n")
		for _, sc := range ReportedScopes(scopes) {
			writeScope(&b, sc)
		}
	}
	if len(degraded) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	w.Write([]byte(b.String()))
}

// serveReady answers 200 "ready" when the node can do its job
// (readers/readiness) and 503 with the conditions that hold otherwise: the
// readiness probe. Unlike /healthz it ignores what does not stop the node
// from masquerading and allocating, e.g. a rejected config edit while the
// last good config is in force.
func (s *Server) serveReady(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if s.ready == nil {
		http.Error(w, "readiness is not tracked: the hive has no readiness.Cell", http.StatusNotImplemented)
		return
	}
	conds := s.ready.NotReady()
	if len(conds) == 0 {
		w.Write([]byte("ready\n"))
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "not ready: %d conditions\n", len(conds))
	for _, c := range conds {
		b.WriteString(c.String() + "\n")
	}
	w.WriteHeader(http.StatusServiceUnavailable)
	w.Write([]byte(b.String()))
}

// serveLive answers 200 while the agent's HTTP server serves: the liveness
// probe. It reads nothing (no map, no table, no lock another goroutine
// may hold long), so that a slow scrape or a condition a restart cannot
// fix (a rejected config, an unreadable Node) never gets the agent
// restarted; only a process that no longer answers does.
func serveLive(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Write([]byte("ok\n"))
}

func writeScope(b *strings.Builder, sc ScopeHealth) {
	fmt.Fprintf(b, "%s: %s", sc.Scope, sc.Level)
	if sc.Message != "" {
		fmt.Fprintf(b, ": %s", sc.Message)
	}
	if sc.Error != "" {
		fmt.Fprintf(b, ": %s", sc.Error)
	}
	b.WriteString("\n")
}

// HealthCmd is the agent's "health" command. Without an argument it prints
// the scopes that have reported a status, sorted, one line each
// ("config.config-file: OK: config generation 3 ..."): the scopes a module
// created but never reported on are left out, so the answer is what an
// operator can act on. With a pattern it is hive's command unchanged: it
// waits until a line "<scope>: level=<level> message=<message>
// error=<error>" matches, the format script tests grep for.
func HealthCmd(h *cell.SimpleHealth) script.Cmd {
	grep := cell.SimpleHealthCmd(h)
	return script.Command(
		script.CmdUsage{
			Summary: "Show the health scopes that have a status, or wait until one matches a pattern",
			Args:    "(pattern)",
			Detail: []string{
				"Without a pattern: every scope with a status, sorted, as '<scope>: <level>: <message>[: <error>]'.",
				"With a pattern: wait until a line '<scope>: level=<level> message=<message> error=<error>' matches it.",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) > 0 {
				return grep.Run(s, args...)
			}
			scopes, err := ReadHealth(s.Context(), h)
			if err != nil {
				return nil, err
			}
			var b strings.Builder
			for _, sc := range ReportedScopes(scopes) {
				writeScope(&b, sc)
			}
			return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
		},
	)
}

// ReportedScopes drops the scopes that have never reported a status (a
// module's parent scope, a job that has not run yet).
func ReportedScopes(scopes []ScopeHealth) []ScopeHealth {
	return slices.DeleteFunc(slices.Clone(scopes), func(sc ScopeHealth) bool {
		return sc.Level == "" || sc.Level == cell.StatusUnknown
	})
}
