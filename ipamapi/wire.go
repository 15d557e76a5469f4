package ipamapi

import (
	"net/netip"
	"time"
)

// DefaultSocket is where the API listens unless --api-socket says otherwise.
const DefaultSocket = "/run/ipmasq/api.sock"

// AllocationRequest is the body of POST /v1/ipam/allocations.
type AllocationRequest struct {
	Owner      string  `json:"owner"`
	Family     string  `json:"family"`
	RouteTable *uint32 `json:"routeTable,omitempty"`
}

// AllocationResponse describes one allocation.
type AllocationResponse struct {
	IP                 netip.Addr     `json:"ip"`
	Owner              string         `json:"owner"`
	RouteTable         uint32         `json:"routeTable"`
	Created            time.Time      `json:"created"`
	NonMasqueradeCIDRs []netip.Prefix `json:"nonMasqueradeCIDRs,omitempty"`
	// Pool is the --pod-cidr pool holding the address: its prefix length
	// is the endpoint's (empty for an endpoint outside the pools).
	Pool string `json:"pool,omitempty"`
}

// ListResponse is the body of GET /v1/ipam/allocations.
type ListResponse struct {
	Allocations []AllocationResponse `json:"allocations"`
}

// ErrorResponse is the body of every error.
type ErrorResponse struct {
	Error string `json:"error"`
}
