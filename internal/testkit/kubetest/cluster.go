package kubetest

import (
	"github.com/ipmasq/ipmasq/internal/testkit/toolbuild"
)

// ProxyBinary returns kube-proxy Version, built from tools/kube-apiserver
// into the user's cache directory the first time (about 2 minutes on 2
// cores), its version stamped as a release build's.
func ProxyBinary() (string, error) {
	return toolbuild.Binary("kube-apiserver", "kube-proxy", Version, "k8s.io/kubernetes/cmd/kube-proxy", "-ldflags", versionLDFlags())
}

// CoreDNSVersion is the CoreDNS release tools/coredns requires.
const CoreDNSVersion = "v1.15.0"

// CoreDNSBinary returns CoreDNS CoreDNSVersion (tools/coredns: its own main
// with the plugins of kubeadm's Corefile), static (CGO_ENABLED=0) for an
// image without a C library, built into the user's cache directory the
// first time.
func CoreDNSBinary() (string, error) {
	return toolbuild.BinaryEnv([]string{"CGO_ENABLED=0"}, "coredns", "coredns", CoreDNSVersion,
		"github.com/ipmasq/ipmasq/tools/coredns", "-trimpath")
}
