package devices_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cells/devices"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/netnstest"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// waitTimeout bounds every wait for the table to catch up with the kernel.
const waitTimeout = 5 * time.Second

// newNetns creates a network namespace for this test only.
func newNetns(t *testing.T) (netns.NsHandle, *netlink.Handle) {
	return privtest.NewNetns(t)
}

// fixture is a devices cell watching a test namespace.
type fixture struct {
	t   *testing.T
	nl  *netlink.Handle
	db  *statedb.DB
	tbl statedb.Table[*tables.EgressDevice]
}

// start runs a hive with the devices cell bound to ns and the given flags.
func start(t *testing.T, ns netns.NsHandle, nl *netlink.Handle, args ...string) *fixture {
	t.Helper()
	f := &fixture{t: t, nl: nl}
	h := hive.New(
		statedb.Cell, job.Cell, cell.SimpleHealthCell,
		devices.Cell,
		netnstest.Devices(ns),
		cell.Invoke(func(db *statedb.DB, tbl statedb.Table[*tables.EgressDevice]) {
			f.db, f.tbl = db, tbl
		}),
	)
	flags := pflag.NewFlagSet("test", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse(args); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		if err := h.Stop(log, ctx); err != nil {
			t.Errorf("stop hive: %v", err)
		}
	})
	return f
}

// wait polls the table, on every change, until check accepts its rows (by
// name) or waitTimeout passes.
func (f *fixture) wait(what string, check func(rows map[string]*tables.EgressDevice) error) {
	f.t.Helper()
	deadline := time.After(waitTimeout)
	for {
		txn := f.db.ReadTxn()
		rows, watch := f.tbl.AllWatch(txn)
		byName := make(map[string]*tables.EgressDevice)
		var dump strings.Builder
		for d := range rows {
			byName[d.Name] = d
			fmt.Fprintf(&dump, "\n  %q", d.TableRow())
		}
		err := errors.New("table not initialized")
		if init, _ := f.tbl.Initialized(txn); init {
			err = check(byName)
		}
		if err == nil {
			return
		}
		select {
		case <-watch:
		case <-deadline:
			f.t.Fatalf("%s: still not true after %s: %v; table:%s", what, waitTimeout, err, dump.String())
		}
	}
}

// want describes the expected state of one device; a nil field is not
// checked.
type want struct {
	selected       *bool
	snatv4, snatv6 *string
	addresses      []string // that must be among the device's addresses
}

func yes() *bool            { b := true; return &b }
func no() *bool             { b := false; return &b }
func addr(s string) *string { return &s }
func noAddr() *string       { return addr("") }
func show(a netip.Addr) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}

// expect waits until every named device matches its want; a nil want
// means the device must have no row.
func (f *fixture) expect(what string, devs map[string]*want) {
	f.t.Helper()
	f.wait(what, func(rows map[string]*tables.EgressDevice) error {
		if lo, ok := rows["lo"]; !ok || !lo.Loopback || lo.Selected {
			return errors.New("loopback has no row, or one that is not marked loopback or is selected")
		}
		for name, w := range devs {
			d, ok := rows[name]
			switch {
			case w == nil && ok:
				return fmt.Errorf("%s still has a row", name)
			case w == nil:
				continue
			case !ok:
				return fmt.Errorf("%s has no row", name)
			case w.selected != nil && d.Selected != *w.selected:
				return fmt.Errorf("%s: selected=%v", name, d.Selected)
			case w.snatv4 != nil && show(d.SNATv4) != *w.snatv4:
				return fmt.Errorf("%s: SNATv4 %q, want %q", name, show(d.SNATv4), *w.snatv4)
			case w.snatv6 != nil && show(d.SNATv6) != *w.snatv6:
				return fmt.Errorf("%s: SNATv6 %q, want %q", name, show(d.SNATv6), *w.snatv6)
			}
			for _, a := range w.addresses {
				if !slices.Contains(d.Addresses, netip.MustParseAddr(a)) {
					return fmt.Errorf("%s: %s missing from %v", name, a, d.Addresses)
				}
			}
		}
		return nil
	})
}

// addVeth creates an up veth pair in the test namespace.
func addVeth(t *testing.T, nl *netlink.Handle, name, peer string) netlink.Link {
	t.Helper()
	if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: peer}); err != nil {
		t.Fatalf("add veth %s/%s: %v", name, peer, err)
	}
	var l netlink.Link
	for _, n := range []string{name, peer} {
		link, err := nl.LinkByName(n)
		if err != nil {
			t.Fatal(err)
		}
		if err := nl.LinkSetUp(link); err != nil {
			t.Fatalf("set %s up: %v", n, err)
		}
		if n == name {
			l = link
		}
	}
	return l
}

// addAddr adds an address, without duplicate address detection so an IPv6
// address is usable at once.
func addAddr(t *testing.T, nl *netlink.Handle, l netlink.Link, cidr string) {
	t.Helper()
	a, err := netlink.ParseAddr(cidr)
	if err != nil {
		t.Fatal(err)
	}
	a.Flags = unix.IFA_F_NODAD
	if err := nl.AddrAdd(l, a); err != nil {
		t.Fatalf("add %s to %s: %v", cidr, l.Attrs().Name, err)
	}
}

func delAddr(t *testing.T, nl *netlink.Handle, l netlink.Link, cidr string) {
	t.Helper()
	a, err := netlink.ParseAddr(cidr)
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.AddrDel(l, a); err != nil {
		t.Fatalf("delete %s from %s: %v", cidr, l.Attrs().Name, err)
	}
}

func defaultRoute(l netlink.Link, gw string) *netlink.Route {
	return &netlink.Route{LinkIndex: l.Attrs().Index, Gw: net.ParseIP(gw)}
}

// setupEth0 creates eth0 (peer peer0) with a primary and a secondary IPv4
// address and an IPv6 address.
func setupEth0(t *testing.T, nl *netlink.Handle) netlink.Link {
	eth0 := addVeth(t, nl, "eth0", "peer0")
	addAddr(t, nl, eth0, "10.0.0.5/24")
	addAddr(t, nl, eth0, "10.0.0.6/24")
	addAddr(t, nl, eth0, "2001:db8::5/64")
	return eth0
}

// TestDefaultRouteDevices follows a node through device and route changes
// without --devices: the devices with a route the node forwards through
// are selected.
func TestDefaultRouteDevices(t *testing.T) {
	ns, nl := newNetns(t)
	eth0 := setupEth0(t, nl)
	if err := nl.RouteAdd(defaultRoute(eth0, "10.0.0.1")); err != nil {
		t.Fatalf("add default route: %v", err)
	}
	f := start(t, ns, nl)

	// 1. The IPv4 default route selects eth0; its SNAT addresses are the
	// primary ones, not the secondary 10.0.0.6.
	f.expect("eth0 selected", map[string]*want{
		"eth0": {selected: yes(), snatv4: addr("10.0.0.5"), snatv6: addr("2001:db8::5"),
			addresses: []string{"10.0.0.5", "10.0.0.6", "2001:db8::5"}},
		"peer0": {selected: no(), snatv4: noAddr(), snatv6: noAddr()},
	})

	// 2. A device that appears later gets a row, unselected.
	eth1 := addVeth(t, nl, "eth1", "peer1")
	f.expect("eth1 picked up", map[string]*want{
		"eth1": {selected: no(), snatv4: noAddr()},
		"eth0": {selected: yes()},
	})

	// 3. An IPv6 address (its connected subnet) and default route select
	// too.
	addAddr(t, nl, eth1, "2001:db8:1::5/64")
	if err := nl.RouteAdd(defaultRoute(eth1, "2001:db8:1::1")); err != nil {
		t.Fatalf("add IPv6 default route: %v", err)
	}
	f.expect("eth1 selected by IPv6 default route", map[string]*want{
		"eth1": {selected: yes(), snatv4: noAddr(), snatv6: addr("2001:db8:1::5")},
		"eth0": {selected: yes()},
	})

	// 4. Without its default route eth0 is still selected by its
	// connected subnets; without those too, it is deselected.
	if err := nl.RouteDel(defaultRoute(eth0, "10.0.0.1")); err != nil {
		t.Fatalf("delete default route: %v", err)
	}
	f.expect("eth0 still selected by its subnets", map[string]*want{
		"eth0": {selected: yes(), snatv4: addr("10.0.0.5")},
		"eth1": {selected: yes()},
	})
	routes, err := nl.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{LinkIndex: eth0.Attrs().Index, Table: unix.RT_TABLE_MAIN},
		netlink.RT_FILTER_OIF|netlink.RT_FILTER_TABLE)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range routes {
		if r.Dst != nil && r.Dst.IP.IsGlobalUnicast() {
			if err := nl.RouteDel(&r); err != nil {
				t.Fatalf("delete eth0's route %s: %v", r.Dst, err)
			}
		}
	}
	f.expect("eth0 deselected", map[string]*want{
		"eth0": {selected: no(), snatv4: addr("10.0.0.5")},
		"eth1": {selected: yes()},
	})

	// 5. Address changes move the SNAT address.
	addAddr(t, nl, eth1, "172.16.0.1/24")
	delAddr(t, nl, eth0, "2001:db8::5/64")
	f.expect("SNAT follows addresses", map[string]*want{
		"eth1": {snatv4: addr("172.16.0.1")},
		"eth0": {snatv4: addr("10.0.0.5"), snatv6: noAddr()},
	})
	// Deleting the primary deletes or promotes the secondary, as the
	// namespace's promote_secondaries says; the SNAT address follows.
	delAddr(t, nl, eth0, "10.0.0.5/24")
	f.wait("eth0 primary gone", func(rows map[string]*tables.EgressDevice) error {
		kernel, err := nl.AddrList(eth0, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		want := ""
		for _, a := range kernel {
			if a.IP.Equal(net.ParseIP("10.0.0.6")) {
				want = "10.0.0.6" // promoted
			}
		}
		if got := show(rows["eth0"].SNATv4); got != want {
			return fmt.Errorf("eth0 SNATv4 %q, want %q", got, want)
		}
		if slices.Contains(rows["eth0"].Addresses, netip.MustParseAddr("10.0.0.5")) {
			return errors.New("10.0.0.5 still listed")
		}
		return nil
	})

	// 6. A deleted device (and its veth peer) loses its row.
	if err := nl.LinkDel(eth1); err != nil {
		t.Fatal(err)
	}
	f.expect("eth1 gone", map[string]*want{"eth1": nil, "peer1": nil, "eth0": {selected: no()}})

	// 7. A device whose only route is in a table of its own (an ip rule's,
	// as a secondary uplink's) is selected; without it, deselected.
	eth2 := addVeth(t, nl, "eth2", "peer2")
	addAddr(t, nl, eth2, "10.2.0.5/24")
	_, connected, _ := net.ParseCIDR("10.2.0.0/24")
	if err := nl.RouteDel(&netlink.Route{LinkIndex: eth2.Attrs().Index, Dst: connected, Table: unix.RT_TABLE_MAIN,
		Scope: netlink.SCOPE_LINK, Protocol: unix.RTPROT_KERNEL, Src: net.ParseIP("10.2.0.5")}); err != nil {
		t.Fatalf("delete eth2's connected route: %v", err)
	}
	f.expect("eth2 without a main-table route", map[string]*want{"eth2": {selected: no()}})
	// The table as a secondary uplink's: its subnet, then its default
	// route (the subnet alone selects too: a connected route).
	table100 := &netlink.Route{LinkIndex: eth2.Attrs().Index, Gw: net.ParseIP("10.2.0.1"), Table: 100}
	if err := nl.RouteAdd(&netlink.Route{LinkIndex: eth2.Attrs().Index, Dst: connected, Table: 100, Scope: netlink.SCOPE_LINK}); err != nil {
		t.Fatalf("add table 100's subnet route: %v", err)
	}
	if err := nl.RouteAdd(table100); err != nil {
		t.Fatalf("add table 100's default route: %v", err)
	}
	f.expect("eth2 selected by table 100's default route", map[string]*want{"eth2": {selected: yes(), snatv4: addr("10.2.0.5")}})
	if err := nl.RouteDel(table100); err != nil {
		t.Fatal(err)
	}
	if err := nl.RouteDel(&netlink.Route{LinkIndex: eth2.Attrs().Index, Dst: connected, Table: 100, Scope: netlink.SCOPE_LINK}); err != nil {
		t.Fatal(err)
	}
	f.expect("eth2 deselected", map[string]*want{"eth2": {selected: no()}})
	if err := nl.LinkDel(eth2); err != nil {
		t.Fatal(err)
	}

	// 8. A rename keeps the row (same index) under the new name, even when
	// the name belonged to another device a moment ago.
	peer0, err := nl.LinkByName("peer0")
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetDown(peer0); err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetName(peer0, "eth1"); err != nil {
		t.Fatal(err)
	}
	f.wait("peer0 renamed eth1", func(rows map[string]*tables.EgressDevice) error {
		if _, ok := rows["peer0"]; ok {
			return errors.New("peer0 still has a row")
		}
		if d, ok := rows["eth1"]; !ok || d.Index != peer0.Attrs().Index || d.Up {
			return fmt.Errorf("eth1 row %+v, want index %d, down", d, peer0.Attrs().Index)
		}
		return nil
	})
}

// TestDevicesFlag: --devices=eth+ selects every eth device, including one
// that appears later, with no regard to routes.
func TestDevicesFlag(t *testing.T) {
	ns, nl := newNetns(t)
	setupEth0(t, nl)
	f := start(t, ns, nl, "--devices=eth+")
	f.expect("eth0 selected", map[string]*want{
		"eth0":  {selected: yes(), snatv4: addr("10.0.0.5"), snatv6: addr("2001:db8::5")},
		"peer0": {selected: no()},
	})
	addVeth(t, nl, "eth1", "peer1")
	f.expect("eth1 selected", map[string]*want{
		"eth0": {selected: yes()}, "eth1": {selected: yes()}, "peer0": {selected: no()}, "peer1": {selected: no()},
	})
}

// TestBadDevicesFlag: a bad --devices value stops the agent from starting,
// with an error that names the flag and the value.
func TestBadDevicesFlag(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		override []string
		value    string
	}{
		{args: []string{"--devices=+"}, value: "+"},
		{args: []string{"--devices=eth/0"}, value: "eth/0"},
		{args: []string{"--devices=eth0,"}, value: ""},
		{args: []string{"--devices=abcdefghijklmnop"}, value: "abcdefghijklmnop"},
		{args: []string{"--devices=eth:1"}, value: "eth:1"},
		{override: []string{"eth 0"}, value: "eth 0"},
	} {
		t.Run(tc.value, func(t *testing.T) {
			h := hive.New(statedb.Cell, job.Cell, cell.SimpleHealthCell, devices.Cell,
				cell.Invoke(func(statedb.Table[*tables.EgressDevice]) {}))
			if tc.override != nil {
				hive.AddConfigOverride(h, func(c *devices.Config) { c.Devices = tc.override })
			}
			flags := pflag.NewFlagSet("test", pflag.ContinueOnError)
			h.RegisterFlags(flags)
			if err := flags.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := h.Populate(hivetest.Logger(t))
			if err == nil {
				t.Fatal("hive populated")
			}
			if want := fmt.Sprintf("--devices=%q", tc.value); !strings.Contains(err.Error(), want) {
				t.Fatalf("error %q does not contain %s", err, want)
			}
		})
	}
}
