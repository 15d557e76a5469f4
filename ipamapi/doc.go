// Package ipamapi is the agent's local IPAM API as its clients see it: the
// request and answer types on the wire and a Client for the unix socket
// (--api-socket). It links no hive, table or kernel code, so a CNI plugin
// or any node-local program can talk to the agent with it alone; the
// server is the agent's cells/api cell.
//
//	POST   /v1/ipam/allocations        {"owner": "...", "family": "ipv4"|"ipv6", "routeTable": 11}
//	                                   201 (new) or 200 (the owner already held it):
//	                                   {"ip", "owner", "routeTable", "created", "nonMasqueradeCIDRs": [...], "pool"}
//	GET    /v1/ipam/allocations        200 {"allocations": [...]}
//	DELETE /v1/ipam/allocations/{ip}   204
//	DELETE /v1/ipam/allocations?owner= 204 (every address of the owner)
//
// Errors are {"error": "..."} with 400 (bad request, unknown field, bad
// family, invalid UTF-8), 404 (no such allocation or endpoint), 409 (conflicting allocation, pool
// exhausted), 413 (body over 64 KiB), 500 (state could not be persisted)
// or 503 (the masquerade config is not loaded yet, after --ipam-config-wait).
package ipamapi
