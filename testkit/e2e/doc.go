// Package e2e holds the end-to-end tests of the masquerade datapath: real
// traffic from a pod namespace through a node namespace running
// ipmasq-agent (as a separate process, like on a node) to external
// namespaces, sent and checked with Go sockets only. See
// cmd/ipmasq-demo/topology for the network.
package e2e
