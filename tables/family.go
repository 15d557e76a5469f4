package tables

import "net/netip"

// Family is an IP address family.
type Family uint8

const (
	// IPv4 is the IPv4 address family.
	IPv4 Family = 4
	// IPv6 is the IPv6 address family.
	IPv6 Family = 6
)

func (f Family) String() string {
	if f == IPv6 {
		return "ipv6"
	}
	return "ipv4"
}

// FamilyOf returns the family of an address (IPv4-mapped IPv6 counts as IPv4).
func FamilyOf(addr netip.Addr) Family {
	if addr.Unmap().Is4() {
		return IPv4
	}
	return IPv6
}
