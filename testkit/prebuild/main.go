// Command prebuild builds, once, every program the tests build from the
// separate modules under tools/ (kube-apiserver, kubelet, kube-scheduler,
// kube-controller-manager, kube-proxy, CoreDNS, the Kubernetes
// ip-masq-agent, ip-masq-agent-v2, promtool) into the user's cache directory, and fetches the
// kernel matrix's Debian kernels (5.10, 6.1, 6.12) there, as the tests
// themselves would on first use. `.ci/run` runs it before `make test`, so
// that a cold machine's 20-odd minutes of building count against no test
// binary's timeout:
//
//	go run ./testkit/prebuild
package main

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
	"github.com/ipmasq/ipmasq/testkit/promtooltest"
	"github.com/ipmasq/ipmasq/testkit/vmtest"
)

// kernelNames is "5.10, 6.1, 6.12".
func kernelNames() string {
	var names []string
	for _, k := range vmtest.Kernels {
		names = append(names, k.Name)
	}
	return strings.Join(names, ", ")
}

func main() {
	for _, b := range []struct {
		name  string
		build func() error
	}{
		{"kube-apiserver", func() error { _, err := kubetest.APIServerBinary(); return err }},
		{"kubelet, kube-scheduler, kube-controller-manager", func() error { _, err := kubetest.NodeBinariesBuilt(); return err }},
		{"kube-proxy", func() error { _, err := kubetest.ProxyBinary(); return err }},
		{"coredns", func() error { _, err := kubetest.CoreDNSBinary(); return err }},
		{"ip-masq-agent", func() error { _, err := kubetest.UpstreamAgentBinary(); return err }},
		{"ip-masq-agent-v2", func() error { _, err := kubetest.UpstreamV2AgentBinary(); return err }},
		{"promtool", func() error { _, err := promtooltest.Binary(); return err }},
		{"kernels " + kernelNames(), func() error {
			for _, k := range vmtest.Kernels {
				if _, err := vmtest.Fetch(k.Name); err != nil {
					return err
				}
			}
			return nil
		}},
	} {
		begin := time.Now()
		if err := b.build(); err != nil {
			fmt.Fprintf(os.Stderr, "prebuild: %s: %v\n", b.name, err)
			os.Exit(1)
		}
		fmt.Printf("prebuild: %s ready (%v)\n", b.name, time.Since(begin).Round(time.Second))
	}
}
