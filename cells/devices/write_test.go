package devices

import (
	"log/slog"
	"testing"

	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/tables"
)

// TestWriteSwappedNames: two devices that swap names between two dumps
// leave the unique name index right.
func TestWriteSwappedNames(t *testing.T) {
	db := statedb.New()
	tbl, err := tables.NewEgressDeviceTable(db)
	if err != nil {
		t.Fatal(err)
	}
	w := newWatcher(slog.New(slog.DiscardHandler), db, tbl, nil, nil, nil)
	if init, _ := tbl.Initialized(db.ReadTxn()); init {
		t.Fatal("table initialized before the first dump")
	}
	if n := w.write(map[int]*tables.EgressDevice{
		2: {Index: 2, Name: "eth0", Selected: true}, 3: {Index: 3, Name: "eth1"}, 4: {Index: 4, Name: "eth2"},
	}); n != 3 {
		t.Fatalf("first write changed %d rows, want 3", n)
	}
	if init, _ := tbl.Initialized(db.ReadTxn()); !init {
		t.Fatal("table not initialized after the first dump")
	}
	if n := w.write(map[int]*tables.EgressDevice{
		2: {Index: 2, Name: "eth1", Selected: true}, 3: {Index: 3, Name: "eth0"}, 4: {Index: 4, Name: "eth2"},
	}); n != 2 {
		t.Fatalf("swap changed %d rows, want 2 (eth2 untouched)", n)
	}
	txn := db.ReadTxn()
	for name, index := range map[string]int{"eth0": 3, "eth1": 2, "eth2": 4} {
		d, _, ok := tbl.Get(txn, tables.EgressDeviceByName.Query(name))
		if !ok || d.Index != index {
			t.Errorf("name %s: got %+v, want index %d", name, d, index)
		}
	}
	if n := w.write(map[int]*tables.EgressDevice{4: {Index: 4, Name: "eth0"}}); n != 3 {
		t.Fatalf("removal and rename changed %d rows, want 3", n)
	}
	if d, _, ok := tbl.Get(db.ReadTxn(), tables.EgressDeviceByName.Query("eth0")); !ok || d.Index != 4 || tbl.NumObjects(db.ReadTxn()) != 1 {
		t.Fatalf("eth0 is %+v, %d rows", d, tbl.NumObjects(db.ReadTxn()))
	}
}
