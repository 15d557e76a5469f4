package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/internal/unixsock"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/tables"
)

// MaxRequestBody bounds request bodies.
const MaxRequestBody = 64 << 10

// Config is the API cell's command-line configuration.
type Config struct {
	// APISocket is the unix socket path of the API.
	APISocket string `mapstructure:"api-socket"`
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("api-socket", def.APISocket, "Unix socket of the agent's local API (IPAM); created with mode 0600 (its directory, if the agent creates it, 0700)")
}

// Cell serves the API.
var Cell = cell.Module(
	"api",
	"Local HTTP API on a unix socket",

	cell.Config(Config{APISocket: ipamapi.DefaultSocket}),
	cell.Invoke(register),
)

func register(lc cell.Lifecycle, log *slog.Logger, health cell.Health, shutdown hive.Shutdowner, cfg Config, i *ipam.IPAM) error {
	if cfg.APISocket == "" {
		return fmt.Errorf("--api-socket is empty: give the path of the API's unix socket, e.g. %s", ipamapi.DefaultSocket)
	}
	s := &server{log: log, health: health, shutdown: shutdown, path: cfg.APISocket, ipam: i}
	lc.Append(cell.Hook{OnStart: s.start, OnStop: s.stop})
	return nil
}

type server struct {
	log      *slog.Logger
	health   cell.Health
	shutdown hive.Shutdowner
	path     string
	ipam     *ipam.IPAM
	srv      *http.Server
}

func (s *server) start(cell.HookContext) error {
	// The socket is the CNI plugin's way in: one removed under the agent
	// is bound again, and one that cannot be is a degraded health. One
	// whose directory was removed on the host under the agent's bind
	// mount can never be reached again: the agent stops with that error,
	// and its restart (the kubelet's) gets the host's directory back.
	ln, err := unixsock.Listen("--api-socket", s.path, socketEvents(s.log, s.health.NewScope("socket"), s.shutdown))
	if err != nil {
		return err
	}
	s.srv = &http.Server{
		Handler: s.routes(),
		// Slow clients cannot hold a connection open forever.
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       60 * time.Second,
	}
	go func() {
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("API server stopped", "socket", s.path, "error", err)
		}
	}()
	s.log.Info("API listening", "socket", s.path)
	return nil
}

func (s *server) stop(ctx cell.HookContext) error {
	if s.srv == nil {
		return nil
	}
	// Shutdown closes the listener, which removes the socket file only
	// while it is still this agent's.
	return s.srv.Shutdown(ctx)
}

// socketEvents logs what the socket's listener reports and keeps a health
// scope of it; a socket that can never be reached again
// (unixsock.ErrDirRemoved) stops the agent with that error.
func socketEvents(log *slog.Logger, health cell.Health, shutdown hive.Shutdowner) func(string, error) {
	health.OK("listening")
	return func(msg string, err error) {
		if err != nil {
			log.Error("API socket unusable", "error", err)
			health.Degraded("API socket unusable", err)
			if errors.Is(err, unixsock.ErrDirRemoved) {
				// The datapath is pinned and keeps translating while the
				// agent restarts.
				shutdown.Shutdown(hive.ShutdownWithError(err))
			}
			return
		}
		log.Warn(msg)
		health.OK(msg)
	}
}

func (s *server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/ipam/allocations", s.allocate)
	mux.HandleFunc("GET /v1/ipam/allocations", s.list)
	mux.HandleFunc("DELETE /v1/ipam/allocations/{ip}", s.releaseIP)
	mux.HandleFunc("DELETE /v1/ipam/allocations", s.releaseOwner)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no such endpoint %s %s", r.Method, r.URL.Path))
	})
	return mux
}

func (s *server) allocate(w http.ResponseWriter, r *http.Request) {
	var req ipamapi.AllocationRequest
	if status, err := decodeStrict(w, r, &req); err != nil {
		writeError(w, status, err.Error())
		return
	}
	var fam tables.Family
	switch req.Family {
	case "ipv4":
		fam = tables.IPv4
	case "ipv6":
		fam = tables.IPv6
	default:
		writeError(w, http.StatusBadRequest, fmt.Sprintf("family %q: want \"ipv4\" or \"ipv6\"", req.Family))
		return
	}
	a, err := s.ipam.Allocate(r.Context(), ipam.Request{Owner: req.Owner, Family: fam, RouteTable: req.RouteTable})
	if err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	status := http.StatusOK
	if a.Created {
		status = http.StatusCreated
	}
	writeAllocation(w, status, a)
}

// writeAllocation writes one allocation as writeJSON(response(...)) would,
// with the CIDR list spliced in as IPAM encoded it once per config: with
// 16 384 prefixes it is almost all of the answer, and encoding it for
// every allocation dominated the latency. The list is written from IPAM's
// copy, not copied into the answer, and the answer's length is announced
// so that it goes out in one piece, not in chunks, and the client can read
// it into one buffer.
func writeAllocation(w http.ResponseWriter, status int, a ipam.Allocation) {
	r := response(a.Endpoint, nil, a.Pool)
	pool := r.Pool
	r.Pool = ""
	head, err := json.Marshal(r) // {"ip":...,"created":"..."}
	if err != nil {
		writeError(w, http.StatusInternalServerError, fmt.Sprintf("encode allocation: %v", err))
		return
	}
	head = head[:len(head)-1]
	var tail []byte
	if len(a.NonMasqueradeCIDRsJSON) > 0 {
		head = append(head, `,"nonMasqueradeCIDRs":`...)
	}
	if pool != "" {
		q, _ := json.Marshal(pool) // a prefix: plain ASCII
		tail = append(tail, `,"pool":`...)
		tail = append(tail, q...)
	}
	tail = append(tail, "}\n"...)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(head)+len(a.NonMasqueradeCIDRsJSON)+len(tail)))
	w.WriteHeader(status)
	// A write error means the client is gone: nothing left to tell it.
	w.Write(head)
	w.Write(a.NonMasqueradeCIDRsJSON)
	w.Write(tail)
}

func (s *server) list(w http.ResponseWriter, r *http.Request) {
	out := ipamapi.ListResponse{Allocations: []ipamapi.AllocationResponse{}}
	for _, ep := range s.ipam.List() {
		cidrs, err := s.ipam.NonMasqueradeCIDRs(ep.Family())
		if err != nil {
			writeError(w, http.StatusInternalServerError, err.Error())
			return
		}
		out.Allocations = append(out.Allocations, response(ep, cidrs.Prefixes, s.ipam.PoolOf(ep.IP)))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *server) releaseIP(w http.ResponseWriter, r *http.Request) {
	ip, err := netip.ParseAddr(r.PathValue("ip"))
	if err != nil {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("%q is not an IP address", r.PathValue("ip")))
		return
	}
	if _, err := s.ipam.Release(ip); err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *server) releaseOwner(w http.ResponseWriter, r *http.Request) {
	owner := r.URL.Query().Get("owner")
	if owner == "" {
		writeError(w, http.StatusBadRequest, "DELETE /v1/ipam/allocations needs ?owner=<owner>, or use /v1/ipam/allocations/{ip}")
		return
	}
	if _, err := s.ipam.ReleaseOwner(owner); err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func response(ep tables.Endpoint, cidrs []netip.Prefix, pool netip.Prefix) ipamapi.AllocationResponse {
	r := ipamapi.AllocationResponse{IP: ep.IP, Owner: ep.Owner, RouteTable: ep.RouteTable, Created: ep.Created, NonMasqueradeCIDRs: cidrs}
	if pool.IsValid() {
		r.Pool = pool.String()
	}
	return r
}

// decodeStrict reads one JSON object with no unknown fields and nothing
// after it, from a body of at most MaxRequestBody bytes.
func decodeStrict(w http.ResponseWriter, r *http.Request, v any) (int, error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBody))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return http.StatusRequestEntityTooLarge, fmt.Errorf("request body over %d bytes", MaxRequestBody)
		}
		return http.StatusBadRequest, fmt.Errorf("read request: %w", err)
	}
	// JSON is UTF-8; the decoder would silently turn invalid bytes into
	// U+FFFD, making different owners look the same.
	if !utf8.Valid(body) {
		return http.StatusBadRequest, errors.New("bad JSON request: the body is not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return http.StatusBadRequest, fmt.Errorf("bad JSON request: %w", err)
	}
	if dec.More() {
		return http.StatusBadRequest, errors.New("bad JSON request: data after the object")
	}
	return 0, nil
}

func statusOf(err error) int {
	switch {
	case errors.Is(err, ipam.ErrInvalid), errors.Is(err, ipam.ErrNoPool):
		return http.StatusBadRequest
	case errors.Is(err, ipam.ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, ipam.ErrConflict), errors.Is(err, ipam.ErrExhausted):
		return http.StatusConflict
	case errors.Is(err, ipam.ErrConfigNotLoaded), errors.Is(err, context.Canceled):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, ipamapi.ErrorResponse{Error: msg})
}
