package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"go.uber.org/dig"

	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/readers/metrics"
	"github.com/ipmasq/ipmasq/settings"
)

// preflight builds the agent's hive (every cell validates its flags while it
// is built) and checks --bpf-root, with the log held: a bad flag ends the
// agent with its one line and nothing before it, while a good start shows
// everything that was logged, in order, once release is called.
type preflight struct {
	// settings is captured while the hive is built, for the --bpf-root check.
	settings *settings.Config
	metrics  *metrics.Config
	held     *heldLog
	// direct is the log without holding, for the warnings release writes.
	direct *slog.Logger
}

// captureSettings is the cell that hands the agent-wide settings and the
// metrics address to preflight; it is an Invoke so that it runs when the hive is built.
func (p *preflight) captureSettings() cell.Cell {
	p.settings, p.metrics = new(settings.Config), new(metrics.Config)
	return cell.Invoke(func(c settings.Config, m metrics.Config) { *p.settings, *p.metrics = c, m })
}

// holdLog returns log with its records held until release.
func (p *preflight) holdLog(log *slog.Logger) *slog.Logger {
	p.held, p.direct = &heldLog{}, log
	return slog.New(&holdHandler{next: log.Handler(), held: p.held})
}

// check builds the hive with log and checks --bpf-root. On error the held
// records are dropped and the error is the cause alone, for one line.
func (p *preflight) check(h *hive.Hive, log *slog.Logger) error {
	if err := h.Populate(log); err != nil {
		p.held.drop()
		return errors.New(strings.TrimPrefix(dig.RootCause(err).Error(), "failed to populate object graph: "))
	}
	if err := checkServeAddr(p.metrics.PrometheusServeAddr); err != nil {
		p.held.drop()
		return err
	}
	if err := bpfmap.CheckBPFFS(p.settings.BPFRoot); err != nil {
		p.held.drop()
		return err
	}
	return nil
}

// checkServeAddr refuses an address the metrics server could never listen
// on before anything starts (a taken port still fails at start).
func checkServeAddr(addr string) error {
	if addr == "" {
		return nil
	}
	_, port, err := net.SplitHostPort(addr)
	if err == nil {
		_, err = strconv.ParseUint(port, 10, 16)
	}
	if err != nil {
		return fmt.Errorf("--prometheus-serve-addr=%q: want [host]:port, e.g. :9464 or 127.0.0.1:9464", addr)
	}
	return nil
}

// release writes warnings, then the held records, and lets every later
// record through at once.
func (p *preflight) release(warnings []string) {
	p.held.release(func() {
		for _, w := range warnings {
			p.direct.Warn("Flag of the Kubernetes ip-masq-agent ignored", "flag", w)
		}
	})
}

// heldLog is the state shared by a holdHandler and those derived from it
// (WithAttrs, WithGroup): the records held so far, in order.
type heldLog struct {
	mu       sync.Mutex
	records  []heldRecord
	released atomic.Bool
}

type heldRecord struct {
	next slog.Handler
	r    slog.Record
}

func (l *heldLog) release(first func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	first()
	for _, h := range l.records {
		_ = h.next.Handle(context.Background(), h.r)
	}
	l.records = nil
	l.released.Store(true)
}

func (l *heldLog) drop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.records = nil
}

// holdHandler holds records in its heldLog until it is released, then
// passes them to next.
type holdHandler struct {
	next slog.Handler
	held *heldLog
}

func (h *holdHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.next.Enabled(ctx, l)
}

func (h *holdHandler) Handle(ctx context.Context, r slog.Record) error {
	if h.held.released.Load() {
		return h.next.Handle(ctx, r)
	}
	h.held.mu.Lock()
	defer h.held.mu.Unlock()
	if h.held.released.Load() {
		return h.next.Handle(ctx, r)
	}
	h.held.records = append(h.held.records, heldRecord{next: h.next, r: r.Clone()})
	return nil
}

func (h *holdHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &holdHandler{next: h.next.WithAttrs(attrs), held: h.held}
}

func (h *holdHandler) WithGroup(name string) slog.Handler {
	return &holdHandler{next: h.next.WithGroup(name), held: h.held}
}
