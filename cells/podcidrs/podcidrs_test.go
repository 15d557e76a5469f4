package podcidrs

import (
	"net/netip"
	"testing"

	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/internal/kubeclient"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

func TestTableHoldsFlagsInOrder(t *testing.T) {
	db := statedb.New()
	tbl, err := newTestTable(db, Config{PodCIDR: []string{"10.244.2.0/24", "fd00:244::/64", "10.1.0.0/24"}})
	if err != nil {
		t.Fatal(err)
	}
	txn := db.ReadTxn()
	if init, _ := tbl.Initialized(txn); !init {
		t.Fatal("pod-cidrs is not initialized after the flag rows are written")
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.244.2.0/24"), netip.MustParsePrefix("fd00:244::/64"), netip.MustParsePrefix("10.1.0.0/24")}
	got := tables.PodCIDRPrefixes(txn, tbl)
	if len(got) != len(want) {
		t.Fatalf("prefixes %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("prefixes %v, want %v", got, want)
		}
	}
	for row := range tbl.All(txn) {
		if row.Origin != tables.PodCIDRFromFlag {
			t.Errorf("%s: source %q, want %q", row.Prefix, row.Origin, tables.PodCIDRFromFlag)
		}
	}
}

func TestTableRejectsBadFlag(t *testing.T) {
	_, err := newTestTable(statedb.New(), Config{PodCIDR: []string{"10.244.1.0/24", "10.244.2.0"}})
	want := `--pod-cidr "10.244.2.0" is not a CIDR (want e.g. 10.244.1.0/24 or fd00:10:244:1::/64)`
	if err == nil || err.Error() != want {
		t.Fatalf("error %v, want %s", err, want)
	}
}

func TestNoFlagInitializedEmpty(t *testing.T) {
	db := statedb.New()
	tbl, err := newTestTable(db, DefaultConfig)
	if err != nil {
		t.Fatal(err)
	}
	if init, _ := tbl.Initialized(db.ReadTxn()); !init || tbl.NumObjects(db.ReadTxn()) != 0 {
		t.Fatalf("initialized=%v rows=%d, want initialized and empty", init, tbl.NumObjects(db.ReadTxn()))
	}
}

// Two sources naming the same prefix are two rows and one prefix.
func TestPrefixesDistinctAcrossSources(t *testing.T) {
	db := statedb.New()
	tbl, err := newTestTable(db, Config{PodCIDR: []string{"10.244.1.0/24"}})
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(tbl)
	tbl.Insert(wtxn, &tables.PodCIDR{Prefix: netip.MustParsePrefix("10.244.1.0/24"), Origin: "node"})
	tbl.Insert(wtxn, &tables.PodCIDR{Prefix: netip.MustParsePrefix("10.245.0.0/24"), Origin: "node", Position: 1})
	wtxn.Commit()
	txn := db.ReadTxn()
	if n := tbl.NumObjects(txn); n != 3 {
		t.Fatalf("%d rows, want 3", n)
	}
	if got := tables.PodCIDRPrefixes(txn, tbl); len(got) != 2 || got[0].String() != "10.244.1.0/24" || got[1].String() != "10.245.0.0/24" {
		t.Fatalf("prefixes %v, want [10.244.1.0/24 10.245.0.0/24]", got)
	}
}

// newTestTable is newTable without Kubernetes, with both families enabled.
func newTestTable(db *statedb.DB, cfg Config) (statedb.RWTable[*tables.PodCIDR], error) {
	agent := settings.Default
	agent.EnableIPv6 = true // off by default
	tbl, _, err := newTable(params{DB: db, Config: cfg, Agent: agent, Client: &kubeclient.Client{}})
	return tbl, err
}
