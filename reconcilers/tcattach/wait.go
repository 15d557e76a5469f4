package tcattach

import (
	"context"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// mapsWrittenWait bounds how long an attachment waits for the masquerade
// sources and node addresses to be in their maps: long enough for the
// first write at start, short enough that a failing map write (reported by
// its own reconciler) does not hold the attachments back.
const mapsWrittenWait = time.Second

// waitMapsWritten returns once masquerade-sources and node-addresses are
// initialized and every row is in its map, or after mapsWrittenWait, so
// that the first packets through a new attachment are decided with the pod
// sources and node addresses in place.
func waitMapsWritten(db *statedb.DB, sources statedb.Table[*tables.MasqueradeSource], addrs statedb.Table[*tables.NodeAddress]) func(context.Context) {
	return func(ctx context.Context) {
		deadline := time.NewTimer(mapsWrittenWait)
		defer deadline.Stop()
		for {
			txn := db.ReadTxn()
			srcRows, srcWatch := sources.AllWatch(txn)
			addrRows, addrWatch := addrs.AllWatch(txn)
			srcInit, srcInitWatch := sources.Initialized(txn)
			addrInit, addrInitWatch := addrs.Initialized(txn)
			// An initialized table's watch channel is closed.
			if srcInit {
				srcInitWatch = nil
			}
			if addrInit {
				addrInitWatch = nil
			}
			done := srcInit && addrInit
			for s := range srcRows {
				done = done && s.Status.Kind == reconciler.StatusKindDone
			}
			for a := range addrRows {
				done = done && a.Status.Kind == reconciler.StatusKindDone
			}
			if done {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-deadline.C:
				return
			case <-srcWatch:
			case <-addrWatch:
			case <-srcInitWatch:
			case <-addrInitWatch:
			}
		}
	}
}
