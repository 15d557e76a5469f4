package devices

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
)

const (
	// settle is how long the watcher waits after the first event of a
	// burst before it dumps: a device coming up sends a link event, a few
	// address events and route events within a few milliseconds.
	settle = 20 * time.Millisecond
	// dumpAttempts bounds the immediate retries of a dump the kernel
	// interrupted because the lists changed while it ran.
	dumpAttempts = 5
	// retryDump is how long a failed dump waits before the next try.
	retryDump = 500 * time.Millisecond
	// minBackoff and maxBackoff bound the wait before re-subscribing after
	// a subscription failed.
	minBackoff = 100 * time.Millisecond
	maxBackoff = 10 * time.Second
)

// initializerName marks egress-devices initialized after the first
// complete dump.
const initializerName = "devices"

// watcher keeps egress-devices equal to what netlink reports. It is driven
// by one goroutine (run), so it needs no locking.
type watcher struct {
	log   *slog.Logger
	db    *statedb.DB
	table statedb.RWTable[*tables.EgressDevice]
	sel   *selector
	ns    *Netns
	// podCIDRs is the pod-cidrs table, nil when the hive has none; its
	// pools mark the pods' gateways (see excludePodGateways).
	podCIDRs statedb.Table[*tables.PodCIDR]
	// podCIDRsChanged closes when pod-cidrs changes after the last dump.
	podCIDRsChanged <-chan struct{}

	// markInitialized marks the table initialized; nil once done.
	markInitialized func(statedb.WriteTxn)
	// lastPorts and lastSelected are what was last logged, so a log line
	// is written on change only.
	lastPorts    string
	lastSelected string
}

func newWatcher(log *slog.Logger, db *statedb.DB, table statedb.RWTable[*tables.EgressDevice], sel *selector, ns *Netns,
	podCIDRs statedb.Table[*tables.PodCIDR]) *watcher {
	w := &watcher{log: log, db: db, table: table, sel: sel, ns: ns, podCIDRs: podCIDRs, lastSelected: "-"}
	wtxn := db.WriteTxn(table)
	w.markInitialized = table.RegisterInitializer(wtxn, initializerName)
	wtxn.Commit()
	return w
}

// run watches until ctx is done, re-subscribing (after a growing pause)
// whenever a subscription fails. Rows stay in the table meanwhile: a
// watch problem must not make the datapath detach.
func (w *watcher) run(ctx context.Context, health cell.Health) error {
	backoff := minBackoff
	for {
		synced, err := w.watch(ctx, health)
		if ctx.Err() != nil {
			return nil
		}
		if synced {
			backoff = minBackoff
		}
		w.log.Warn("Device watch failed; re-subscribing", "error", err, "retryIn", backoff)
		health.Degraded("netlink device watch failed, re-subscribing", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// watch subscribes to netlink notifications, dumps at once and again after
// every burst of relevant notifications, until ctx is done or a
// subscription ends. synced tells whether at least one dump succeeded.
func (w *watcher) watch(ctx context.Context, health cell.Health) (synced bool, err error) {
	h, err := w.newHandle()
	if err != nil {
		return false, err
	}
	defer h.Close()

	// Subscribe before dumping, so that no change falls between the two.
	subs, err := w.subscribe()
	defer subs.close()
	if err != nil {
		return false, err
	}

	timer := time.NewTimer(0)
	defer timer.Stop()
	pending := true
	trigger := func() {
		if !pending {
			pending = true
			timer.Reset(settle)
		}
	}
	for {
		select {
		case <-ctx.Done():
			return synced, nil
		case err := <-subs.errs:
			// A notification may have been lost: dump again. If the
			// subscription ended, its channel closes next.
			w.log.Debug("Netlink notification error; resyncing", "error", err)
			subs.lastErr = err
			trigger()
		case _, ok := <-subs.links:
			if !ok {
				return synced, subs.ended("link")
			}
			trigger()
		case _, ok := <-subs.addrs:
			if !ok {
				return synced, subs.ended("address")
			}
			trigger()
		case u, ok := <-subs.routes:
			if !ok {
				return synced, subs.ended("route")
			}
			// A node with a full routing table sends many route events;
			// only main-table routes to global destinations select
			// devices.
			if routeMatters(u.Route) {
				trigger()
			}
		case <-w.podCIDRsChanged:
			w.podCIDRsChanged = nil
			trigger()
		case <-timer.C:
			pending = false
			if err := w.sync(h, health); err != nil {
				w.log.Warn("Device dump failed; retrying", "error", err, "retryIn", retryDump)
				health.Degraded("netlink device dump failed", err)
				pending = true
				timer.Reset(retryDump)
				continue
			}
			synced = true
		}
	}
}

func (w *watcher) newHandle() (*netlink.Handle, error) {
	if w.ns == nil {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return nil, fmt.Errorf("open netlink handle: %w", err)
		}
		return h, nil
	}
	h, err := netlink.NewHandleAt(w.ns.Handle, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("open netlink handle in namespace %s: %w", w.ns.Handle, err)
	}
	return h, nil
}

// subscriptions are the netlink notification channels of one watch.
type subscriptions struct {
	done   chan struct{}
	errs   chan error
	links  chan netlink.LinkUpdate
	addrs  chan netlink.AddrUpdate
	routes chan netlink.RouteUpdate // nil with --devices: routes do not matter
	// lastErr is the last error netlink reported.
	lastErr error
}

// subscribe opens the link, address and (without --devices) route
// subscriptions. On error, the returned subscriptions hold those that were
// opened and must still be closed.
func (w *watcher) subscribe() (*subscriptions, error) {
	s := &subscriptions{done: make(chan struct{}), errs: make(chan error, 16)}
	onError := func(err error) {
		select {
		case s.errs <- err:
		default: // a resync is already due
		}
	}
	var ns *netns.NsHandle
	if w.ns != nil {
		h := w.ns.Handle
		ns = &h
	}

	links := make(chan netlink.LinkUpdate, 64)
	if err := netlink.LinkSubscribeWithOptions(links, s.done,
		netlink.LinkSubscribeOptions{Namespace: ns, ErrorCallback: onError}); err != nil {
		return s, fmt.Errorf("subscribe to link notifications: %w", err)
	}
	s.links = links

	addrs := make(chan netlink.AddrUpdate, 64)
	if err := netlink.AddrSubscribeWithOptions(addrs, s.done,
		netlink.AddrSubscribeOptions{Namespace: ns, ErrorCallback: onError}); err != nil {
		return s, fmt.Errorf("subscribe to address notifications: %w", err)
	}
	s.addrs = addrs

	if w.sel == nil {
		routes := make(chan netlink.RouteUpdate, 256)
		if err := netlink.RouteSubscribeWithOptions(routes, s.done,
			netlink.RouteSubscribeOptions{Namespace: ns, ErrorCallback: onError}); err != nil {
			return s, fmt.Errorf("subscribe to route notifications: %w", err)
		}
		s.routes = routes
	}
	return s, nil
}

// ended describes a subscription whose channel closed, with the error
// netlink reported for it (e.g. a receive buffer overflow).
func (s *subscriptions) ended(what string) error {
	select {
	case err := <-s.errs:
		s.lastErr = err
	default:
	}
	if s.lastErr == nil {
		return fmt.Errorf("%s subscription ended", what)
	}
	return fmt.Errorf("%s subscription ended: %w", what, s.lastErr)
}

// close ends the subscriptions and waits for their goroutines: each
// closes its channel once its socket is closed, and must not be left
// blocked on a send.
func (s *subscriptions) close() {
	close(s.done)
	if s.links != nil {
		for range s.links {
		}
	}
	if s.addrs != nil {
		for range s.addrs {
		}
	}
	if s.routes != nil {
		for range s.routes {
		}
	}
}

// sync dumps netlink and writes the rows that differ.
func (w *watcher) sync(h *netlink.Handle, health cell.Health) error {
	snap, err := w.dump(h)
	if err != nil {
		return err
	}
	snap.podPools = w.podPools()
	want, ports := desired(snap, w.sel)
	changed := w.write(want)
	w.report(ports, health, changed)
	return nil
}

// podPools returns the node's own pod CIDRs (not --cluster-cidr, which
// spans every node) and arms podCIDRsChanged. It does not wait for the
// table's initialization: the devices are listed at once, and listed again
// when the pools arrive.
func (w *watcher) podPools() []netip.Prefix {
	if w.podCIDRs == nil || w.sel != nil {
		return nil
	}
	rows, changed := w.podCIDRs.AllWatch(w.db.ReadTxn())
	w.podCIDRsChanged = changed
	var pools []netip.Prefix
	for c := range rows {
		if c.IsPool() {
			pools = append(pools, c.Prefix)
		}
	}
	return pools
}

// dump takes a snapshot, retrying when the kernel interrupted a dump.
func (w *watcher) dump(h *netlink.Handle) (snapshot, error) {
	var err error
	for range dumpAttempts {
		var s snapshot
		s, err = dumpOnce(h, w.sel == nil)
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return s, err
		}
	}
	return snapshot{}, fmt.Errorf("dump interrupted %d times in a row: %w", dumpAttempts, err)
}

func dumpOnce(h *netlink.Handle, withRoutes bool) (snapshot, error) {
	links, err := h.LinkList()
	if err != nil {
		return snapshot{}, fmt.Errorf("list links: %w", err)
	}
	addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return snapshot{}, fmt.Errorf("list addresses: %w", err)
	}
	s := snapshot{links: links, addrs: addrs}
	if withRoutes {
		s.routes = []netlink.Route{}
		// Table 0 with the table filter: every table's routes.
		err := h.RouteListFilteredIter(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE,
			func(r netlink.Route) bool {
				if routeMatters(r) {
					s.routes = append(s.routes, r)
				}
				return true
			})
		if err != nil {
			return snapshot{}, fmt.Errorf("list routes: %w", err)
		}
	}
	return s, nil
}

// write makes the table hold exactly want, touching only rows that change,
// and returns how many rows were inserted, changed or deleted.
func (w *watcher) write(want map[int]*tables.EgressDevice) int {
	wtxn := w.db.WriteTxn(w.table)
	defer wtxn.Abort()
	changed := 0
	for row := range w.table.All(wtxn) {
		d, ok := want[row.Index]
		switch {
		case ok && d.Equal(row):
			delete(want, row.Index)
		case !ok:
			w.table.Delete(wtxn, row)
			changed++
			w.log.Debug("Device gone", "name", row.Name, "index", row.Index)
		case d.Name != row.Name:
			// Renamed: free the old name first, another device may take
			// it in this transaction.
			w.table.Delete(wtxn, row)
		}
	}
	for _, d := range want {
		w.table.Insert(wtxn, d)
		changed++
		w.log.Debug("Device updated", "name", d.Name, "index", d.Index, "selected", d.Selected,
			"snatv4", d.SNATv4, "snatv6", d.SNATv6)
	}
	if w.markInitialized != nil {
		w.markInitialized(wtxn)
		w.markInitialized = nil
	}
	wtxn.Commit()
	return changed
}

// report logs changes of the selection and sets health.
func (w *watcher) report(ports []portMatch, health cell.Health, changed int) {
	var p []string
	for _, m := range ports {
		p = append(p, fmt.Sprintf("%s (port of %s)", m.name, m.master))
	}
	slices.Sort(p)
	if s := strings.Join(p, ", "); s != w.lastPorts {
		w.lastPorts = s
		if s != "" {
			w.log.Warn("--devices matches ports of a bridge, bond or team; they are not selected: "+
				"masquerading happens on the master, select it instead", "ports", s)
		}
	}

	txn := w.db.ReadTxn()
	var sel []string
	for _, d := range tables.SelectedEgressDevices(txn, w.table) {
		sel = append(sel, fmt.Sprintf("%s (%s)", d.Name, snatSummary(d)))
	}
	selected := strings.Join(sel, ", ")
	if selected != w.lastSelected {
		w.lastSelected = selected
		w.log.Info("Egress devices selected", "devices", selected, "by", w.sel.String())
	}
	n := w.table.NumObjects(txn)
	if selected == "" {
		health.OK(fmt.Sprintf("%d device(s), none selected (%s)", n, w.sel))
	} else {
		health.OK(fmt.Sprintf("%d device(s), masquerading on %s", n, selected))
	}
	if changed > 0 {
		w.log.Debug("Devices synced", "changedRows", changed)
	}
}

func snatSummary(d *tables.EgressDevice) string {
	var s []string
	for _, a := range []netip.Addr{d.SNATv4, d.SNATv6} {
		if a.IsValid() {
			s = append(s, a.String())
		}
	}
	if len(s) == 0 {
		return "no SNAT address"
	}
	return strings.Join(s, ", ")
}
