// Command coredns is CoreDNS (github.com/coredns/coredns) with the plugins
// of a Kubernetes cluster's default Corefile (kubeadm's) and no others: the
// real-node test's cluster DNS (testkit/nodee2e) runs it as the
// kube-dns Deployment. It is CoreDNS' own main (coremain.Run) with a
// shorter plugin list, the way CoreDNS documents custom builds; the full
// list would pull in every cloud SDK for nothing.
package main

import (
	"github.com/coredns/coredns/coremain"

	// The plugins kubeadm's Corefile names.
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func main() {
	coremain.Run()
}
