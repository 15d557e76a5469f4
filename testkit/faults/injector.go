package faults

import (
	"errors"
	"sync"
)

// The fault points: one per reconciler that writes into the kernel, named
// like the reconciler.
const (
	// NonMasqMaps fails the writes of nonmasq-cidrs into the nonmasq LPM maps.
	NonMasqMaps = "nonmasq-maps"
	// IPRules fails the netlink writes of per-endpoint ip rules.
	IPRules = "ip-rules"
	// TCAttach fails the attachment of the programs to datapath devices.
	TCAttach = "tc-attach"
	// MasqRules fails the writes of masquerade rules into masq_rules_v4/v6.
	MasqRules = "masq-rules"
	// MasqSources fails the writes of masquerade sources (pod CIDRs) into
	// masq_src_v4/v6.
	MasqSources = "masq-sources"
	// NodeAddresses fails the writes of the node's addresses into
	// node_addrs_v4/v6.
	NodeAddresses = "node-addresses"
)

// Points lists the fault points the agent's reconcilers wrap.
var Points = []string{NonMasqMaps, IPRules, TCAttach, MasqRules, MasqSources, NodeAddresses}

// ErrInjected is the error of a point failed without an error of its own.
var ErrInjected = errors.New("injected fault")

// Injector holds which fault points fail, with what error, and how many
// operations each one has failed. It is safe for concurrent use: the
// reconcilers consult it from their own goroutines while a test changes it.
type Injector struct {
	mu     sync.Mutex
	points map[string]*point
}

type point struct {
	err      error // nil: the point calls through
	injected int
}

// New returns an Injector with no point failing.
func New() *Injector {
	return &Injector{points: map[string]*point{}}
}

func (i *Injector) point(name string) *point {
	p, ok := i.points[name]
	if !ok {
		p = &point{}
		i.points[name] = p
	}
	return p
}

// Fail makes every operation at the point fail with err (ErrInjected when
// err is nil) until Clear. The count of failed operations keeps running
// across Fail calls.
func (i *Injector) Fail(point string, err error) {
	if err == nil {
		err = ErrInjected
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	i.point(point).err = err
}

// Clear lets the operations at the point call through again.
func (i *Injector) Clear(point string) {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.point(point).err = nil
}

// Injected returns how many operations the point has failed so far. A batch
// counts one operation per object in it.
func (i *Injector) Injected(point string) int {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.point(point).injected
}

// inject returns the error n operations at the point must fail with, and
// counts them, or nil when the point is not failing.
func (i *Injector) inject(point string, n int) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	p := i.point(point)
	if p.err != nil {
		p.injected += n
	}
	return p.err
}
