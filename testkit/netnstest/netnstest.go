// Package netnstest runs the agent's namespace-bound work in a network
// namespace a test created, so that a test hive never sees, attaches to or
// tunes the host's own devices. Test tooling only: production code provides
// none of it (the agent works in its own namespace).
package netnstest

import (
	"context"
	"fmt"
	"iter"
	"net/netip"
	"runtime"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/vishvananda/netns"

	"github.com/ipmasq/ipmasq/cells/devices"
	"github.com/ipmasq/ipmasq/cells/netfilter"
	"github.com/ipmasq/ipmasq/tables"
)

// Agent wraps cells holding the devices cell, the datapath and the
// netfilter cell (e.g. agent.Cell): the devices cell lists ns's devices, and the datapath
// attaches its programs in ns, and netfilter's
// NAT rules are read and watched in ns.
func Agent(ns netns.NsHandle, cells ...cell.Cell) cell.Cell {
	return cell.Group(
		Devices(ns),
		cell.Decorate(func(ops reconciler.Operations[*tables.DatapathDevice], scan netfilter.Scanner, changes netfilter.Changes) (reconciler.Operations[*tables.DatapathDevice], netfilter.Scanner, netfilter.Changes) {
			return &inNetns[*tables.DatapathDevice]{ns: ns, ops: ops},
				func(sources []netip.Prefix) (rows []*tables.NetfilterNATRule, err error) {
					err = Do(ns, func() error { rows, err = scan(sources); return err })
					return rows, err
				},
				func(ctx context.Context) (ch <-chan struct{}, err error) {
					err = Do(ns, func() error { ch, err = changes(ctx); return err })
					return ch, err
				}
		}, cells...),
	)
}

// Devices makes the devices cell list ns's devices. Only for a hive
// without the datapath: with it, use Agent, or the programs would be
// attached to the host's devices of the same index.
func Devices(ns netns.NsHandle) cell.Cell {
	return cell.Provide(func() *devices.Netns { return &devices.Netns{Handle: ns} })
}

// Do runs fn with the calling thread inside ns, for operations that resolve
// interface indexes in the caller's namespace (tcx attach, /proc/sys/net).
func Do(ns netns.NsHandle, fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return fmt.Errorf("get network namespace: %w", err)
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		return fmt.Errorf("enter network namespace: %w", err)
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			// The thread is unusable; never hand it back to the runtime.
			panic(fmt.Sprintf("restore network namespace: %v", err))
		}
	}()
	return fn()
}

// inNetns runs each operation inside ns.
type inNetns[Obj any] struct {
	ns  netns.NsHandle
	ops reconciler.Operations[Obj]
}

func (n *inNetns[Obj]) Update(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	return Do(n.ns, func() error { return n.ops.Update(ctx, txn, rev, obj) })
}

func (n *inNetns[Obj]) Delete(ctx context.Context, txn statedb.ReadTxn, rev statedb.Revision, obj Obj) error {
	return Do(n.ns, func() error { return n.ops.Delete(ctx, txn, rev, obj) })
}

func (n *inNetns[Obj]) Prune(ctx context.Context, txn statedb.ReadTxn, objs iter.Seq2[Obj, statedb.Revision]) error {
	return Do(n.ns, func() error { return n.ops.Prune(ctx, txn, objs) })
}
