package tables

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// EgressDeviceTableName is the name of the table of the node's network
// devices and which of them masquerade.
const EgressDeviceTableName = "egress-devices"

// EgressDevice is one network device of the node, as the devices cell
// last saw it in netlink. The datapath reconciler attaches
// the masquerading programs to the Selected devices and translates to their
// SNAT addresses.
type EgressDevice struct {
	// Index is the kernel's interface index, stable for the device's
	// lifetime (a rename keeps it).
	Index int `json:"index" yaml:"index"`
	// Name is the interface name, e.g. eth0.
	Name string `json:"name" yaml:"name"`
	// Up is true when the device is administratively up and has carrier
	// (IFF_UP and IFF_RUNNING). It does not affect Selected: a program
	// stays attached while a link flaps.
	Up bool `json:"up" yaml:"up"`
	// Ethernet is true when the device's frames carry an Ethernet header;
	// on other devices (wireguard, tun, ppp, ipip) the packet starts at
	// the IP header and the datapath must parse it from there.
	Ethernet bool `json:"ethernet" yaml:"ethernet"`
	// L3 is true when packets on the device start at the network header:
	// no link-layer header at all (tun, WireGuard, ipip, sit, ip6tnl,
	// point-to-point GRE, ppp, raw IP). A device that is neither Ethernet
	// nor L3 (a GRE device without a remote builds its own header) gets
	// no programs.
	L3 bool `json:"l3" yaml:"l3"`
	// Loopback is true for the loopback device. Its addresses are the
	// node's (BGP and anycast nodes put the node's address there, and a
	// route's src picks it as the source of masqueraded flows), but nothing
	// leaves through it: it is never Selected and has no SNAT address.
	Loopback bool `json:"loopback" yaml:"loopback"`
	// Selected is true when traffic leaving through the device is
	// masqueraded: it matches --devices or, without that flag, a forwarded
	// packet can leave through it (a main-table route to a global
	// destination: the default route, a route via a gateway, a connected
	// subnet) and it is not one of the pods' own interfaces. Never for
	// loopback.
	Selected bool `json:"selected" yaml:"selected"`
	// Reason says why the device is selected ("default route",
	// "route 192.0.2.0/24 via 10.1.0.1", "route 10.1.0.0/24",
	// "--devices eth+"), or why a device with routes is not ("pod gateway
	// (10.244.1.1 in pod CIDR 10.244.1.0/24)", "port of br0"). Empty for a
	// device that nothing leaves through.
	Reason string `json:"reason,omitempty" yaml:"reason,omitempty"`
	// Addresses are all the device's addresses, of every scope, sorted.
	Addresses []netip.Addr `json:"addresses" yaml:"addresses"`
	// SNATv4 is the address IPv4 traffic is masqueraded to: the device's
	// primary global address. Zero when the device has none.
	SNATv4 netip.Addr `json:"snatv4" yaml:"snatv4"`
	// SNATv6 is the address IPv6 traffic is masqueraded to: the device's
	// first stable global address. Zero when the device has none.
	SNATv6 netip.Addr `json:"snatv6" yaml:"snatv6"`
}

// SNAT returns the masquerade address of the given family; zero when the
// device has none.
func (d *EgressDevice) SNAT(f Family) netip.Addr {
	if f == IPv4 {
		return d.SNATv4
	}
	return d.SNATv6
}

// Equal reports whether two rows describe the device identically, so a
// writer can leave an unchanged row alone.
func (d *EgressDevice) Equal(o *EgressDevice) bool {
	return d.Index == o.Index && d.Name == o.Name && d.Up == o.Up && d.Ethernet == o.Ethernet && d.L3 == o.L3 &&
		d.Loopback == o.Loopback &&
		d.Selected == o.Selected && d.Reason == o.Reason && d.SNATv4 == o.SNATv4 && d.SNATv6 == o.SNATv6 &&
		slices.Equal(d.Addresses, o.Addresses)
}

// TableHeader implements statedb.TableWritable.
func (d *EgressDevice) TableHeader() []string {
	return []string{"Name", "Index", "Up", "Ethernet", "L3", "Loopback", "Selected", "Addresses", "SNATv4", "SNATv6", "Reason"}
}

// TableRow implements statedb.TableWritable. A missing SNAT address is an
// empty column.
func (d *EgressDevice) TableRow() []string {
	addrs := make([]string, len(d.Addresses))
	for i, a := range d.Addresses {
		addrs[i] = a.String()
	}
	return []string{
		d.Name, strconv.Itoa(d.Index), strconv.FormatBool(d.Up), strconv.FormatBool(d.Ethernet), strconv.FormatBool(d.L3),
		strconv.FormatBool(d.Loopback), strconv.FormatBool(d.Selected), strings.Join(addrs, ","), addrString(d.SNATv4), addrString(d.SNATv6),
		d.Reason,
	}
}

// addrString shows the zero address as an empty string rather than
// "invalid IP".
func addrString(a netip.Addr) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}

var (
	// EgressDeviceByIndex is the primary index, by interface index.
	EgressDeviceByIndex = statedb.Index[*EgressDevice, int]{
		Name: "index",
		FromObject: func(d *EgressDevice) index.KeySet {
			return index.NewKeySet(index.Int(d.Index))
		},
		FromKey:    index.Int,
		FromString: index.IntString,
		Unique:     true,
	}
	// EgressDeviceByName finds a device by its interface name.
	EgressDeviceByName = statedb.Index[*EgressDevice, string]{
		Name: "name",
		FromObject: func(d *EgressDevice) index.KeySet {
			return index.NewKeySet(index.String(d.Name))
		},
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	// EgressDeviceBySelected lists the devices that masquerade (true) or
	// do not (false).
	EgressDeviceBySelected = statedb.Index[*EgressDevice, bool]{
		Name: "selected",
		FromObject: func(d *EgressDevice) index.KeySet {
			return index.NewKeySet(index.Bool(d.Selected))
		},
		FromKey:    index.Bool,
		FromString: index.BoolString,
		Unique:     false,
	}
)

// NewEgressDeviceTable creates the egress-devices table.
func NewEgressDeviceTable(db *statedb.DB) (statedb.RWTable[*EgressDevice], error) {
	return statedb.NewTable(db, EgressDeviceTableName, EgressDeviceByIndex, EgressDeviceByName, EgressDeviceBySelected)
}

// SelectedEgressDevices returns the devices that masquerade, by index.
func SelectedEgressDevices(txn statedb.ReadTxn, tbl statedb.Table[*EgressDevice]) []*EgressDevice {
	return statedb.Collect(tbl.List(txn, EgressDeviceBySelected.Query(true)))
}
