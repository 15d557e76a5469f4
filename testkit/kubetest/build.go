package kubetest

import (
	"fmt"
	"strings"

	"github.com/ipmasq/ipmasq/testkit/toolbuild"
)

// Version is the Kubernetes release the tests run against: the version the
// tools/kube-apiserver module requires.
const Version = "v1.37.2"

// APIServerBinary returns the path of kube-apiserver Version, building it
// from tools/kube-apiserver into the user's cache directory the first time
// (about 5 minutes on 2 cores).
func APIServerBinary() (string, error) {
	return toolbuild.Binary("kube-apiserver", "kube-apiserver", Version, "k8s.io/kubernetes/cmd/kube-apiserver")
}

// NodeBinaries are the Kubernetes programs of a node and its control plane
// besides the API server: the paths of kubelet, kube-scheduler and
// kube-controller-manager Version.
type NodeBinaries struct {
	Kubelet, Scheduler, ControllerManager string
}

// NodeBinariesBuilt returns kubelet, kube-scheduler and
// kube-controller-manager Version, building them from tools/kube-apiserver
// into the user's cache directory the first time (about 7 minutes on 2
// cores, most of it the kubelet), with their version stamped as a release
// build's is: the kubelet reports it on its Node.
func NodeBinariesBuilt() (NodeBinaries, error) {
	var bins NodeBinaries
	for _, b := range []struct {
		path *string
		name string
	}{{&bins.Kubelet, "kubelet"}, {&bins.Scheduler, "kube-scheduler"}, {&bins.ControllerManager, "kube-controller-manager"}} {
		var err error
		*b.path, err = toolbuild.Binary("kube-apiserver", b.name, Version, "k8s.io/kubernetes/cmd/"+b.name, "-ldflags", versionLDFlags())
		if err != nil {
			return NodeBinaries{}, err
		}
	}
	return bins, nil
}

// versionLDFlags stamp Version into component-base, as Kubernetes' release
// builds do; a plain go build reports v0.0.0-master.
func versionLDFlags() string {
	major, rest, _ := strings.Cut(strings.TrimPrefix(Version, "v"), ".")
	minor, _, _ := strings.Cut(rest, ".")
	const v = "k8s.io/component-base/version."
	return fmt.Sprintf("-X %sgitVersion=%s -X %sgitMajor=%s -X %sgitMinor=%s", v, Version, v, major, v, minor)
}
