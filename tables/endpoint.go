package tables

import (
	"net/netip"
	"strconv"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// EndpointTableName is the name of the table of allocated endpoint addresses.
const EndpointTableName = "endpoints"

// Endpoint is an address handed out by IPAM to one owner (a container, a
// pod interface). Endpoints with a route table get per-endpoint ip rules.
type Endpoint struct {
	// IP is the endpoint's address.
	IP netip.Addr `json:"ip" yaml:"ip"`
	// Owner identifies who holds the address, e.g. a container ID and
	// interface or namespace/pod. An owner holds at most one address per
	// family.
	Owner string `json:"owner" yaml:"owner"`
	// RouteTable is the routing table of the endpoint's own interface; 0
	// means none (no ip rules).
	RouteTable uint32 `json:"routeTable" yaml:"routeTable"`
	// Created is when the address was allocated.
	Created time.Time `json:"created" yaml:"created"`
}

// TableHeader implements statedb.TableWritable.
func (e *Endpoint) TableHeader() []string {
	return []string{"IP", "Owner", "RouteTable", "Created"}
}

// TableRow implements statedb.TableWritable.
func (e *Endpoint) TableRow() []string {
	return []string{e.IP.String(), e.Owner, strconv.FormatUint(uint64(e.RouteTable), 10), e.Created.UTC().Format(time.RFC3339)}
}

// Family is the endpoint's address family.
func (e *Endpoint) Family() Family { return FamilyOf(e.IP) }

var (
	// EndpointByIP is the primary index.
	EndpointByIP = statedb.Index[*Endpoint, netip.Addr]{
		Name: "ip",
		FromObject: func(e *Endpoint) index.KeySet {
			return index.NewKeySet(index.NetIPAddr(e.IP))
		},
		FromKey:    index.NetIPAddr,
		FromString: index.NetIPAddrString,
		Unique:     true,
	}
	// EndpointByOwner finds an owner's endpoints. It is not unique because
	// a dual-stack owner holds one address of each family; IPAM enforces
	// one address per owner and family.
	EndpointByOwner = statedb.Index[*Endpoint, string]{
		Name: "owner",
		FromObject: func(e *Endpoint) index.KeySet {
			return index.NewKeySet(index.String(e.Owner))
		},
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     false,
	}
)

// NewEndpointTable creates the endpoints table.
func NewEndpointTable(db *statedb.DB) (statedb.RWTable[*Endpoint], error) {
	return statedb.NewTable(db, EndpointTableName, EndpointByIP, EndpointByOwner)
}
