package tables

// NATSizing says how the datapath sized its NAT maps: the entries per
// family and why (the node's conntrack limit, the container's memory limit,
// --nat-max-entries), as logged at start ("NAT maps sized"). The datapath
// (reconcilers/datapath) provides it; status shows it. Empty: no datapath.
type NATSizing struct {
	Summary string
}
