package kubetest

import (
	"github.com/ipmasq/ipmasq/testkit/toolbuild"
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

// UpstreamAgentVersion is the commit of the Kubernetes ip-masq-agent kept
// in tools/ip-masq-agent (git describe of kubernetes-sigs/ip-masq-agent).
const UpstreamAgentVersion = "v2.12.6-12-ge300086"

// UpstreamAgentBinary returns the Kubernetes ip-masq-agent
// UpstreamAgentVersion (tools/ip-masq-agent: its unmodified source),
// static (CGO_ENABLED=0) as its own release images build it, its version
// stamped as its Makefile does, built into the user's cache directory the
// first time.
func UpstreamAgentBinary() (string, error) {
	return toolbuild.BinaryEnv([]string{"CGO_ENABLED=0"}, "ip-masq-agent", "ip-masq-agent", UpstreamAgentVersion,
		"./cmd/ip-masq-agent", "-trimpath", "-ldflags", "-X k8s.io/ip-masq-agent/pkg/version.Version="+UpstreamAgentVersion)
}

// UpstreamV2AgentVersion is the commit of Azure's ip-masq-agent-v2 kept in
// tools/ip-masq-agent-v2 (git describe of Azure/ip-masq-agent-v2).
const UpstreamV2AgentVersion = "v0.1.15-3-g45758a6"

// UpstreamV2AgentBinary returns Azure's ip-masq-agent-v2
// UpstreamV2AgentVersion (tools/ip-masq-agent-v2: its unmodified source,
// its dependencies from the Go module proxy checked against its go.sum),
// static, built into the user's cache directory the first time.
func UpstreamV2AgentBinary() (string, error) {
	return toolbuild.BinaryEnv([]string{"CGO_ENABLED=0"}, "ip-masq-agent-v2", "ip-masq-agent-v2", UpstreamV2AgentVersion,
		"./cmd/ip-masq-agent-v2", "-trimpath", "-ldflags", "-X github.com/Azure/ip-masq-agent-v2/pkg/version.Version="+UpstreamV2AgentVersion)
}
