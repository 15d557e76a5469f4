// Package natview lists the datapath's NAT pairs the way conntrack -L lists
// connections: every pair with its protocol, original and translated tuple,
// state, age and time to expiry, filtered, as text or JSON, or counted by
// state (conntrack -S, -C). It reads the pinned NAT maps read-only, in
// batches, so it works with or without a running agent:
//
//	ipmasq-agent nat                                   # every pair, one line each
//	ipmasq-agent nat --proto tcp --state tcp-established --dst 198.51.100.0/24
//	ipmasq-agent nat --src 10.244.1.2 --port 53 -o json
//	ipmasq-agent nat --summary                         # fill per family, pairs by kind and state
//	ipmasq-agent nat --count                           # the number of (matching) pairs
//	ipmasq-agent shell 'datapath/nat --proto udp'      # the same, from the running agent
//
// The NAT entries hold no packet or byte counters (see bpf.NATPair), so
// neither does the listing.
package natview
