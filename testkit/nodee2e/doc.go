// Package nodee2e proves ipmasq on a real Kubernetes node: a kubelet and
// containerd (in a network namespace and a mount namespace of their own)
// run the agent's image from deploy/ against a real API server, scheduler
// and controller manager, and the pods they start get their addresses from
// ipmasq-cni and are masqueraded. TestRealNodeForeignCNI gives the pods a
// network that is not ipmasq's instead (Debian's bridge and host-local
// plugins on a Calico-like /26 outside the Node's spec.podCIDRs) and
// installs the image of plain `make image` with `kubectl apply -k
// deploy/` unedited. TestRealNodeMigration, on that network, moves the node
// from the Kubernetes ip-masq-agent itself (tools/ip-masq-agent, in an
// image with Debian's iptables) to ipmasq and back as docs/migrate.md
// says, with flows running throughout. Everything is in its test files;
// the pods' workload is podprog.
//
// TestFleet (fleet*_test.go) is a cluster of several such nodes with the
// components every cluster runs: the real kube-proxy (iptables mode) on
// each node and CoreDNS (tools/coredns) as the kube-dns Deployment,
// behind a router that is also the external host and its resolver.
//
// Needs root, the Debian packages containerd, runc, iptables and
// etcd-server (and conntrack for the fleet), and builds kubelet,
// kube-scheduler, kube-controller-manager, kube-proxy and CoreDNS once into
// the user's cache (testkit/kubetest).
package nodee2e
