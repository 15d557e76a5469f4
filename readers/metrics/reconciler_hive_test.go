package metrics

import (
	"context"
	"errors"
	"iter"
	"net/http/httptest"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// thing is a row of a reconciled test table.
type thing struct {
	ID     uint64
	Faulty bool
	Status reconciler.Status
}

func (o *thing) Clone() *thing                        { o2 := *o; return &o2 }
func (o *thing) GetStatus() reconciler.Status         { return o.Status }
func (o *thing) SetStatus(s reconciler.Status) *thing { o.Status = s; return o }
func (o *thing) TableHeader() []string                { return []string{"ID"} }
func (o *thing) TableRow() []string                   { return []string{"thing"} }

var thingByID = statedb.Index[*thing, uint64]{
	Name:       "id",
	FromObject: func(o *thing) index.KeySet { return index.NewKeySet(index.Uint64(o.ID)) },
	FromKey:    index.Uint64,
	Unique:     true,
}

type thingOps struct{}

func (thingOps) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, o *thing) error {
	if o.Faulty {
		return errors.New("faulty thing")
	}
	return nil
}

func (thingOps) Delete(context.Context, statedb.ReadTxn, statedb.Revision, *thing) error { return nil }

func (thingOps) Prune(context.Context, statedb.ReadTxn, iter.Seq2[*thing, statedb.Revision]) error {
	return nil
}

// TestReconcilersUseMetrics: a reconciler registered with the hive's
// reconciler.Params reports through the cell's metrics, with nothing but
// the cell in the hive.
func TestReconcilersUseMetrics(t *testing.T) {
	var (
		db     *statedb.DB
		things statedb.RWTable[*thing]
		srv    *Server
	)
	h := hive.New(
		statedb.Cell, job.Cell, cell.SimpleHealthCell,
		Cell,
		cell.Module("things", "Reconciles things",
			cell.ProvidePrivate(func(r job.Registry, health cell.Health) job.Group { return r.NewGroup(health) }),
			cell.Invoke(func(p reconciler.Params) error {
				var err error
				if things, err = statedb.NewTable(p.DB, "things", thingByID); err != nil {
					return err
				}
				_, err = reconciler.Register(p, things, (*thing).Clone, (*thing).SetStatus, (*thing).GetStatus,
					thingOps{}, nil, reconciler.WithName("things"))
				return err
			})),
		cell.Invoke(func(d *statedb.DB, s *Server) { db, srv = d, s }),
	)
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })

	wtxn := db.WriteTxn(things)
	things.Insert(wtxn, &thing{ID: 1, Status: reconciler.StatusPending()})
	things.Insert(wtxn, &thing{ID: 2, Faulty: true, Status: reconciler.StatusPending()})
	wtxn.Commit()

	// The server is off; its handler still serves.
	ts := httptest.NewServer(srv.Handler())
	defer ts.Close()
	waitFor(t, ts.URL+"/metrics", map[string]float64{
		`ipmasq_reconciler_current_errors{module="things",reconciler="things"}`:                                      1,
		`ipmasq_reconciler_operation_duration_seconds_count{module="things",operation="update",reconciler="things"}`: 2,
	})
}
