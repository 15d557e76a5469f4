package tables

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/statedb"
)

func TestEgressDeviceTableRow(t *testing.T) {
	d := &EgressDevice{
		Index: 2, Name: "eth0", Up: true, Ethernet: true, Selected: true,
		Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("2001:db8::5")},
		SNATv4:    netip.MustParseAddr("10.0.0.5"), Reason: "default route",
	}
	got := d.TableRow()
	want := []string{"eth0", "2", "true", "true", "false", "false", "true", "10.0.0.5,2001:db8::5", "10.0.0.5", "", "default route"}
	if !slices.Equal(got, want) {
		t.Fatalf("TableRow() = %q, want %q", got, want)
	}
	if len(d.TableHeader()) != len(got) {
		t.Fatalf("header has %d columns, row %d", len(d.TableHeader()), len(got))
	}
	empty := (&EgressDevice{Index: 3, Name: "eth1"}).TableRow()
	if empty[7] != "" || empty[8] != "" || empty[9] != "" {
		t.Fatalf("a device without addresses shows %q", empty)
	}
	if d.SNAT(IPv4) != d.SNATv4 || d.SNAT(IPv6).IsValid() {
		t.Fatalf("SNAT(family) does not return the family's address")
	}
}

func TestEgressDeviceEqual(t *testing.T) {
	a := &EgressDevice{Index: 2, Name: "eth0", Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}
	b := *a
	b.Addresses = slices.Clone(a.Addresses)
	if !a.Equal(&b) {
		t.Fatal("copies are not equal")
	}
	b.Addresses = append(b.Addresses, netip.MustParseAddr("10.0.0.6"))
	if a.Equal(&b) {
		t.Fatal("rows with different addresses are equal")
	}
	lo := *a
	lo.Loopback = true
	if a.Equal(&lo) {
		t.Fatal("a loopback row equals a non-loopback one")
	}
}

// TestEgressDeviceIndexes: the string forms the db/get and db/list script
// commands use find rows by index, name and selection.
func TestEgressDeviceIndexes(t *testing.T) {
	db := statedb.New()
	tbl, err := NewEgressDeviceTable(db)
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(tbl)
	tbl.Insert(wtxn, &EgressDevice{Index: 2, Name: "eth0", Selected: true})
	tbl.Insert(wtxn, &EgressDevice{Index: 3, Name: "eth1"})
	tbl.Insert(wtxn, &EgressDevice{Index: 10, Name: "wg0", Selected: true})
	txn := wtxn.Commit()

	for _, tc := range []struct {
		index, key string
		want       []string
	}{
		{"index", "3", []string{"eth1"}},
		{"name", "eth0", []string{"eth0"}},
		{"selected", "true", []string{"eth0", "wg0"}},
		{"selected", "false", []string{"eth1"}},
	} {
		rows, err := statedb.AnyTable{Meta: tbl}.List(txn, tc.index, tc.key)
		if err != nil {
			t.Fatalf("%s=%s: %v", tc.index, tc.key, err)
		}
		var got []string
		for d := range rows {
			got = append(got, d.(*EgressDevice).Name)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s=%s: got %v, want %v", tc.index, tc.key, got, tc.want)
		}
	}

	var sel []string
	for _, d := range SelectedEgressDevices(txn, tbl) {
		sel = append(sel, d.Name)
	}
	if !slices.Equal(sel, []string{"eth0", "wg0"}) {
		t.Fatalf("SelectedEgressDevices = %v", sel)
	}
}
