// Package perf measures the masquerade datapath against its two baselines
// in one run on one kind of topology (cmd/ipmasq-demo/topology.Masquerade): plain
// routing without NAT (the limit), ipmasq, and iptables MASQUERADE behind a
// chain of one RETURN per non-masquerade CIDR, the way the Kubernetes
// ip-masq-agent does it. It reports TCP throughput and new connections per
// second through the node, and their ratios per round.
//
//	go test -run '^$' -bench Datapath -benchtime 1x ./testkit/perf/
//
// Traffic comes from two small processes, the test binary started again
// with RoleEnv set: a client in the pod namespace pinned to one CPU and the
// servers in the external namespace pinned to the other. See
// docs/datapath-benchmarks.md for the method and the results.
package perf
