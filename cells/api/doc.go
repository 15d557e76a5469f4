// Package api serves the agent's local HTTP API on a unix socket
// (--api-socket, mode 0600): IPAM allocations for CNI plugins and other
// node-local clients. The protocol, its types and the client are package
// ipamapi, which clients link without this cell's hive and tables.
package api
