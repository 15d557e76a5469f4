package ipam

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/tables"
)

var (
	// ErrConfigNotLoaded means the first masquerade config, or the node's
	// pod CIDRs (from its Node), were not known within --ipam-config-wait.
	ErrConfigNotLoaded = errors.New("the masquerade config has not been loaded yet")
	// ErrPoolsNotKnown means the pod CIDRs were not known within
	// --ipam-config-wait (the Node was not read yet); it is an
	// ErrConfigNotLoaded.
	ErrPoolsNotKnown = fmt.Errorf("%w: the pod CIDRs are not known yet", ErrConfigNotLoaded)
	// ErrNotFound means no endpoint has the given address or owner.
	ErrNotFound = errors.New("no such allocation")
	// ErrConflict means the owner already holds an address of the family
	// with a different route table.
	ErrConflict = errors.New("conflicting allocation")
	// ErrInvalid means the request itself is wrong.
	ErrInvalid = errors.New("invalid request")
)

// Request asks for an address.
type Request struct {
	// Owner identifies the holder, e.g. "<container ID>/eth0".
	Owner string
	// Family is the address family wanted.
	Family tables.Family
	// RouteTable is the endpoint's route table; nil means
	// --egress-route-table.
	RouteTable *uint32
}

// Allocation is an endpoint with the no-masquerade CIDRs of its family.
type Allocation struct {
	Endpoint tables.Endpoint
	// NonMasqueradeCIDRs come from the nonmasq-cidrs table. The slice is
	// shared with other answers of the same config: do not modify it.
	NonMasqueradeCIDRs []netip.Prefix
	// NonMasqueradeCIDRsJSON is NonMasqueradeCIDRs as a JSON array (nil
	// when empty), encoded once per config.
	NonMasqueradeCIDRsJSON []byte
	// Created is false when the owner already held the address.
	Created bool
	// Pool is the pool (pod CIDR) holding the address (zero for an
	// endpoint outside the current pools).
	Pool netip.Prefix
}

// IPAM allocates endpoint addresses. It is the only writer of the
// endpoints table.
type IPAM struct {
	log       *slog.Logger
	db        *statedb.DB
	endpoints statedb.RWTable[*tables.Endpoint]
	cidrs     statedb.Table[*tables.NonMasqCIDR]
	podCIDRs  statedb.Table[*tables.PodCIDR]
	devices   statedb.Table[*tables.EgressDevice] // nil without the devices cell
	pools     poolsCache
	store     *Store
	config    Config
	stateDir  string
	health    cell.Health

	// mu serializes changes so that the state file and the table agree.
	mu         sync.Mutex
	saveFailed bool

	// One compaction at a time, in the background: it rewrites the
	// snapshot, which an allocation should not wait for.
	pendingHealth cell.Health

	compacting    atomic.Bool
	compactions   sync.WaitGroup
	compactHealth cell.Health

	cidrLists cidrCache
}

// restore fills the endpoints table from disk and marks it initialized.
func (i *IPAM) restore() error {
	eps, report, err := i.store.Load()
	if err != nil {
		return fmt.Errorf("restore endpoints: %w (fix or remove the file; starting empty would hand out addresses in use)", err)
	}
	wtxn := i.db.WriteTxn(i.endpoints)
	done := i.endpoints.RegisterInitializer(wtxn, "ipam-state")
	pools := i.pools.get(wtxn, i.podCIDRs)
	var outside []string
	for _, ep := range eps {
		i.endpoints.Insert(wtxn, ep)
		if !pools.Usable(ep.IP) {
			outside = append(outside, ep.IP.String()+" ("+ep.Owner+")")
		}
	}
	done(wtxn)
	wtxn.Commit()

	var problems []string
	problems = append(problems, report.Problems...)
	if len(outside) > 0 {
		// Kept: the owner still uses the address; it is only not
		// handed out again.
		problems = append(problems, fmt.Sprintf("%d restored endpoint(s) outside the --pod-cidr pools, kept: %s",
			len(outside), strings.Join(outside, ", ")))
	}
	for _, p := range problems {
		i.log.Warn("Endpoint state", "problem", p, "file", i.store.Path())
	}
	if len(problems) > 0 {
		i.health.Degraded("endpoint state restored with problems", errors.New(strings.Join(problems, "; ")))
	} else {
		i.health.OK(fmt.Sprintf("%d endpoint(s) restored from %s", len(eps), report.Origin))
	}
	i.log.Info("Endpoints restored", "count", len(eps), "origin", report.Origin, "replayed", report.Replayed, "file", i.store.Path())

	// Start from a fresh snapshot and an empty journal. Failing is not
	// fatal: the journal holds everything, and changes tell whether the
	// disk works.
	i.compact()
	return nil
}

// maybeCompact starts a compaction in the background when the journal
// has grown enough and none is running. Called after a change commits.
func (i *IPAM) maybeCompact() {
	if !i.store.NeedsCompaction() || !i.compacting.CompareAndSwap(false, true) {
		return
	}
	i.compactions.Go(func() {
		defer i.compacting.Store(false)
		i.compact()
	})
}

func (i *IPAM) compact() {
	if err := i.store.Compact(); err != nil {
		i.log.Warn("Cannot compact the endpoint journal", "error", err, "journal", i.store.JournalPath())
		i.compactHealth.Degraded("cannot compact the endpoint journal; allocations stay durable, the journal grows until it works", err)
		return
	}
	i.compactHealth.OK("snapshot written to " + i.store.Path())
}

// stop waits for a compaction in progress and closes the journal.
func (i *IPAM) stop(cell.HookContext) error {
	i.compactions.Wait()
	if i.store == nil {
		return nil
	}
	return i.store.Close()
}

// Allocate returns the owner's address of the family, allocating one if it
// has none. It waits for the first config load (bounded by
// --ipam-config-wait) so the answer always carries the real CIDRs.
func (i *IPAM) Allocate(ctx context.Context, req Request) (Allocation, error) {
	if strings.TrimSpace(req.Owner) == "" {
		return Allocation{}, fmt.Errorf("%w: owner is empty", ErrInvalid)
	}
	if req.Family != tables.IPv4 && req.Family != tables.IPv6 {
		return Allocation{}, fmt.Errorf("%w: family must be ipv4 or ipv6", ErrInvalid)
	}
	table := i.config.EgressRouteTable
	if req.RouteTable != nil {
		table = *req.RouteTable
	}
	if err := i.releasePendingOf(req.Owner); err != nil {
		return Allocation{}, err
	}
	if err := i.waitForConfig(ctx); err != nil {
		return Allocation{}, err
	}
	if err := i.waitForPools(ctx); err != nil {
		return Allocation{}, err
	}

	i.mu.Lock()
	defer i.mu.Unlock()
	wtxn := i.db.WriteTxn(i.endpoints)
	defer wtxn.Abort()
	for ep := range i.endpoints.List(wtxn, tables.EndpointByOwner.Query(req.Owner)) {
		if ep.Family() != req.Family {
			continue
		}
		if ep.RouteTable != table {
			return Allocation{}, fmt.Errorf("%w: owner %q already holds %s with route table %d (release it first)",
				ErrConflict, req.Owner, ep.IP, ep.RouteTable)
		}
		return i.allocation(ep, false)
	}
	node := i.nodeAddrs(wtxn)
	ip, err := i.pools.get(wtxn, i.podCIDRs).Next(req.Family, func(a netip.Addr) bool {
		if node[a] {
			return true
		}
		_, _, used := i.endpoints.Get(wtxn, tables.EndpointByIP.Query(a))
		return used
	})
	if err != nil {
		return Allocation{}, err
	}
	ep := &tables.Endpoint{IP: ip, Owner: req.Owner, RouteTable: table, Created: time.Now().UTC().Truncate(time.Second)}
	if err := i.persist(func() error { return i.store.Add(ep) }); err != nil {
		return Allocation{}, err
	}
	i.endpoints.Insert(wtxn, ep)
	wtxn.Commit()
	i.maybeCompact()
	i.log.Info("Allocated", "ip", ip, "owner", req.Owner, "routeTable", table)
	return i.allocation(ep, true)
}

func (i *IPAM) allocation(ep *tables.Endpoint, created bool) (Allocation, error) {
	cidrs, err := i.cidrLists.get(i.db.ReadTxn(), i.cidrs, ep.Family())
	if err != nil {
		return Allocation{}, err
	}
	return Allocation{
		Endpoint:               *ep,
		NonMasqueradeCIDRs:     cidrs.Prefixes,
		NonMasqueradeCIDRsJSON: cidrs.JSON,
		Created:                created,
		Pool:                   i.PoolOf(ep.IP),
	}, nil
}

func (i *IPAM) waitForConfig(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, i.config.IPAMConfigWait)
	defer cancel()
	if _, err := tables.WaitForConfig(ctx, i.db, i.cidrs); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("%w after %s: %v", ErrConfigNotLoaded, i.config.IPAMConfigWait, err)
		}
		return err
	}
	return nil
}

// waitForPools waits until the pod-cidrs table is complete: at once with
// --pod-cidr, after the Node (or its copy on disk) was read with
// --k8s-node-name.
func (i *IPAM) waitForPools(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, i.config.IPAMConfigWait)
	defer cancel()
	for {
		init, watch := i.podCIDRs.Initialized(i.db.ReadTxn())
		if init {
			return nil
		}
		select {
		case <-watch:
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("%w after %s (waiting for the Node's spec.podCIDRs)", ErrPoolsNotKnown, i.config.IPAMConfigWait)
			}
			return ctx.Err()
		}
	}
}

// nodeAddrs are the node's own addresses, never handed out: an address
// that a device of the node holds inside a pool (the pods' gateway on a
// bridge, a misconfigured device) would be answered by the node itself.
func (i *IPAM) nodeAddrs(txn statedb.ReadTxn) map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	if i.devices == nil {
		return out
	}
	for d := range i.devices.All(txn) {
		for _, a := range d.Addresses {
			out[a] = true
		}
	}
	return out
}

// Release frees an address. Releasing it twice is ErrNotFound.
func (i *IPAM) Release(ip netip.Addr) (tables.Endpoint, error) {
	return i.release(func(txn statedb.ReadTxn) []*tables.Endpoint {
		ep, _, ok := i.endpoints.Get(txn, tables.EndpointByIP.Query(ip.Unmap()))
		if !ok {
			return nil
		}
		return []*tables.Endpoint{ep}
	}, "ip "+ip.String())
}

// ReleaseOwner frees every address of an owner.
func (i *IPAM) ReleaseOwner(owner string) ([]tables.Endpoint, error) {
	var released []tables.Endpoint
	_, err := i.release(func(txn statedb.ReadTxn) []*tables.Endpoint {
		eps := statedb.Collect(i.endpoints.List(txn, tables.EndpointByOwner.Query(owner)))
		for _, ep := range eps {
			released = append(released, *ep)
		}
		return eps
	}, "owner "+owner)
	return released, err
}

func (i *IPAM) release(find func(statedb.ReadTxn) []*tables.Endpoint, what string) (tables.Endpoint, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	wtxn := i.db.WriteTxn(i.endpoints)
	defer wtxn.Abort()
	eps := find(wtxn)
	if len(eps) == 0 {
		return tables.Endpoint{}, fmt.Errorf("%w: %s", ErrNotFound, what)
	}
	// One record per address: if a later one fails, the table drops
	// exactly the addresses whose release is on disk.
	var err error
	released := 0
	for _, ep := range eps {
		if err = i.persist(func() error { return i.store.Delete(ep.IP) }); err != nil {
			break
		}
		i.endpoints.Delete(wtxn, ep)
		i.log.Info("Released", "ip", ep.IP, "owner", ep.Owner)
		released++
	}
	if released > 0 {
		wtxn.Commit()
		i.maybeCompact()
	}
	if err != nil {
		return tables.Endpoint{}, err
	}
	return *eps[0], nil
}

// persist makes a change durable; the caller commits the table only when
// it succeeded, so the table never runs ahead of the disk.
func (i *IPAM) persist(change func() error) error {
	if err := change(); err != nil {
		i.health.Degraded("cannot persist endpoints; allocations and releases fail until it works", err)
		i.saveFailed = true
		return fmt.Errorf("persist endpoints: %w", err)
	}
	if i.saveFailed {
		i.saveFailed = false
		i.health.OK(fmt.Sprintf("endpoints persisted to %s again", i.store.Path()))
	}
	return nil
}

// PoolOf returns the pool holding ip, or the zero prefix.
func (i *IPAM) PoolOf(ip netip.Addr) netip.Prefix {
	for _, p := range i.pools.get(i.db.ReadTxn(), i.podCIDRs).Prefixes(tables.FamilyOf(ip)) {
		if p.Contains(ip) {
			return p
		}
	}
	return netip.Prefix{}
}

// List returns every endpoint in address order.
func (i *IPAM) List() []tables.Endpoint {
	var out []tables.Endpoint
	for ep := range i.endpoints.All(i.db.ReadTxn()) {
		out = append(out, *ep)
	}
	return out
}

// NonMasqueradeCIDRs lists the no-masquerade CIDRs of a family from memory.
// The list is shared with other readers of the same config: do not modify
// it.
func (i *IPAM) NonMasqueradeCIDRs(f tables.Family) (*CIDRList, error) {
	return i.cidrLists.get(i.db.ReadTxn(), i.cidrs, f)
}
