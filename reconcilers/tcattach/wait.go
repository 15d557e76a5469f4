package tcattach

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// mapsWrittenWait bounds how long an attachment waits for the tables the
// programs decide by to be in their maps: long enough for the first writes
// at start on a loaded node, short enough that a failing map write
// (reported by its own reconciler) does not hold the attachments back for
// good.
const mapsWrittenWait = 5 * time.Second

// writtenTable is one table whose rows a reconciler writes into a map the
// programs read.
type writtenTable struct {
	name string
	// written reports whether the table is initialized and every row is
	// Done, and the channels that close when that may have changed.
	written func(statedb.ReadTxn) (bool, []<-chan struct{})
}

// tableWritten is the writtenTable of tbl, whose rows carry their
// reconciler's status.
func tableWritten[Obj interface{ GetStatus() reconciler.Status }](tbl statedb.Table[Obj]) writtenTable {
	return writtenTable{name: tbl.Name(), written: func(txn statedb.ReadTxn) (bool, []<-chan struct{}) {
		rows, watch := tbl.AllWatch(txn)
		init, initWatch := tbl.Initialized(txn)
		watches := []<-chan struct{}{watch}
		// An initialized table's watch channel is closed: not waited on.
		if !init {
			watches = append(watches, initWatch)
		}
		done := init
		for row := range rows {
			done = done && row.GetStatus().Kind == reconciler.StatusKindDone
		}
		return done, watches
	}}
}

// mapsWrittenTables are what the programs decide a packet by besides the
// device's own entry: the masquerade sources, the node's addresses, the
// user's masquerade rules and the non-masquerade prefixes. A device
// attached before the last is written masquerades traffic bound for a
// non-masquerade range (pod to pod across nodes, a VPC peer).
type mapsWrittenTables struct {
	cell.In

	Sources     statedb.Table[*tables.MasqueradeSource]
	NodeAddrs   statedb.Table[*tables.NodeAddress]
	RuleSources statedb.Table[*tables.MasqueradeRuleSource]
	NonMasq     statedb.Table[*tables.NonMasqCIDR]
}

func (m mapsWrittenTables) list() []writtenTable {
	return []writtenTable{tableWritten(m.Sources), tableWritten(m.NodeAddrs),
		tableWritten(m.RuleSources), tableWritten(m.NonMasq)}
}

// notWrittenMessage is logged when an attachment stops waiting for the maps.
const notWrittenMessage = "Attaching before every map is written: their reconcilers report why"

// waitMapsWritten returns once every table of tbls is initialized and
// every row is in its map, or after mapsWrittenWait (logging which are
// not), so that the first packets through a new attachment are decided
// with the whole config in place.
func waitMapsWritten(db *statedb.DB, log *slog.Logger, tbls mapsWrittenTables) func(context.Context) {
	list := tbls.list()
	return func(ctx context.Context) {
		waitCtx, cancel := context.WithTimeout(ctx, mapsWrittenWait)
		defer cancel()
		for {
			txn := db.ReadTxn()
			var pending []string
			ws := statedb.NewWatchSet()
			for _, t := range list {
				done, watches := t.written(txn)
				if !done {
					pending = append(pending, t.name)
				}
				ws.Add(watches...)
			}
			if len(pending) == 0 {
				return
			}
			if _, err := ws.Wait(waitCtx, 0); err != nil {
				if ctx.Err() == nil {
					log.Warn(notWrittenMessage,
						"notWritten", strings.Join(pending, ", "), "waited", mapsWrittenWait)
				}
				return
			}
		}
	}
}
