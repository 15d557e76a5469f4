package netfilter

import (
	"context"
	"fmt"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
)

// Changes tells of changes to netfilter's rules while ctx lives: a value
// on the channel means "scan again"; the channel is closed once ctx ends. The agent's is WatchNftables in its
// own namespace; nil leaves the scan to ScanInterval alone.
type Changes func(ctx context.Context) (<-chan struct{}, error)

// changeSettle is how long a burst of rule changes (an iptables-restore
// writes many) is let settle before the scan, and the least time between
// two scans that changes cause: kube-proxy rewrites its rules often, and a
// scan of a large ruleset is not free.
const changeSettle = time.Second

// WatchNftables tells of every nftables table, chain and rule added or
// deleted in the calling thread's network namespace (nftables' netlink
// notifications, NFNLGRP_NFTABLES), so that a MASQUERADE chain put back or
// removed is seen at once instead of at the next scan. iptables-nft rules
// are nftables rules; iptables-legacy changes send no notification and are
// seen by the periodic scan only. If the notifications stop (e.g. the
// socket's buffer overran under a burst), the watch opens again after a
// second and says so on the channel, so that nothing missed stays unseen.
func WatchNftables(ctx context.Context) (<-chan struct{}, error) {
	// The namespace is held, so that a monitor opened again from another
	// thread watches the same one.
	ns, err := netns.Get()
	if err != nil {
		return nil, fmt.Errorf("network namespace: %w", err)
	}
	events, stop, err := openNftablesMonitor(ns)
	if err != nil {
		ns.Close()
		return nil, err
	}
	out := make(chan struct{}, 1)
	notify := func() {
		select {
		case out <- struct{}{}:
		default: // one pending notification is enough
		}
	}
	go func() {
		defer close(out)
		defer ns.Close()
		for {
			select {
			case <-ctx.Done():
				stop()
				return
			case _, ok := <-events:
				if ok {
					notify()
					continue
				}
			}
			// The monitor ended on an error: open it again.
			stop()
			for events = nil; events == nil; {
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Second):
				}
				events, stop, _ = openNftablesMonitor(ns)
			}
			notify()
		}
	}()
	return out, nil
}

// openNftablesMonitor subscribes to nftables' table, chain and rule
// notifications in ns; stop ends the subscription and drains its channel.
func openNftablesMonitor(ns netns.NsHandle) (<-chan *nftables.MonitorEvent, func(), error) {
	// Not a lasting connection: the monitor then dials a socket of its
	// own, which its Close closes (a lasting one's would not be, and the
	// monitor would never end).
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return nil, nil, fmt.Errorf("nftables netlink: %w", err)
	}
	mon := nftables.NewMonitor(nftables.WithMonitorObject(nftables.MonitorObjectRuleset))
	events, err := conn.AddMonitor(mon)
	if err != nil {
		return nil, nil, fmt.Errorf("nftables notifications: %w", err)
	}
	stop := func() {
		mon.Close()
		for range events {
			// the monitor's goroutines end once their channel is drained
		}
	}
	return events, stop, nil
}
