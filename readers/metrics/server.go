package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ipmasq/ipmasq/readers/readiness"
)

// Paths of the probes (deploy/daemonset.yaml uses them).
const (
	// HealthPath: 200, or 503 with every degraded health scope.
	HealthPath = "/healthz"
	// ReadyPath: the readiness probe; 200 when the node can do its job
	// (readers/readiness), 503 with the conditions that hold.
	ReadyPath = "/readyz"
	// LivePath: the liveness probe; 200 while the agent answers.
	LivePath = "/livez"
)

// Server is the HTTP server of /metrics, /healthz, /readyz and /livez.
type Server struct {
	cfg    Config
	log    *slog.Logger
	mux    *http.ServeMux
	health *cell.SimpleHealth
	ready  *readiness.Checker

	mu   sync.Mutex
	srv  *http.Server
	addr net.Addr
}

type serverParams struct {
	cell.In

	Config   Config
	Log      *slog.Logger
	Registry *prometheus.Registry
	// Health is read for /healthz; without it /healthz answers 501.
	Health *cell.SimpleHealth `optional:"true"`
	// Readiness answers /readyz; without it /readyz answers 501.
	Readiness *readiness.Checker `optional:"true"`
}

func newServer(p serverParams) *Server {
	s := &Server{cfg: p.Config, log: p.Log, health: p.Health, ready: p.Readiness, mux: http.NewServeMux()}
	s.mux.Handle("GET /metrics", promhttp.HandlerFor(p.Registry, promhttp.HandlerOpts{
		// A source that fails (e.g. a NAT map read) costs its own metrics,
		// not the whole scrape.
		ErrorHandling: promhttp.ContinueOnError,
		ErrorLog:      scrapeErrorLog{p.Log},
	}))
	s.mux.HandleFunc("GET "+HealthPath, s.serveHealth)
	s.mux.HandleFunc("GET "+ReadyPath, s.serveReady)
	s.mux.HandleFunc("GET "+LivePath, serveLive)
	return s
}

// Handler serves /metrics, /healthz, /readyz and /livez; it works whether or not the server
// listens, for a host agent that serves it on its own server.
func (s *Server) Handler() http.Handler { return s.mux }

// Addr is the address the server listens on, or nil when
// --prometheus-serve-addr is empty or the hive is not running. With port 0
// it tells which port was chosen.
func (s *Server) Addr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

func (s *Server) register(lc cell.Lifecycle) {
	if s.cfg.PrometheusServeAddr == "" {
		return
	}
	lc.Append(cell.Hook{OnStart: s.start, OnStop: s.stop})
}

func (s *Server) start(cell.HookContext) error {
	// Listen in the start hook so that a taken port stops the agent with
	// an error rather than leaving it running without its metrics.
	ln, err := net.Listen("tcp", s.cfg.PrometheusServeAddr)
	if err != nil {
		return fmt.Errorf("--prometheus-serve-addr=%s: %w", s.cfg.PrometheusServeAddr, err)
	}
	srv := &http.Server{Handler: s.mux, ReadHeaderTimeout: 10 * time.Second}
	s.mu.Lock()
	s.srv, s.addr = srv, ln.Addr()
	s.mu.Unlock()
	s.log.Info("Serving metrics and health", "addr", ln.Addr().String())
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("Metrics server failed", "addr", ln.Addr().String(), "error", err)
		}
	}()
	return nil
}

func (s *Server) stop(ctx cell.HookContext) error {
	s.mu.Lock()
	srv := s.srv
	s.srv, s.addr = nil, nil
	s.mu.Unlock()
	if srv == nil {
		return nil
	}
	if err := srv.Shutdown(ctx); err != nil {
		// Scrapes still running when the stop timeout ends are cut off.
		srv.Close()
		if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return nil
}

// scrapeErrorLog logs the errors of a scrape (promhttp.Logger).
type scrapeErrorLog struct{ log *slog.Logger }

func (l scrapeErrorLog) Println(v ...any) {
	l.log.Warn("Metrics scrape incomplete", "error", fmt.Sprint(v...))
}
