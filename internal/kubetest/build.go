package kubetest

import "github.com/ipmasq/ipmasq/internal/toolbuild"

// Version is the Kubernetes release the tests run against: the version the
// tools/kube-apiserver module requires.
const Version = "v1.37.2"

// APIServerBinary returns the path of kube-apiserver Version, building it
// from tools/kube-apiserver into the user's cache directory the first time
// (about 5 minutes on 2 cores).
func APIServerBinary() (string, error) {
	return toolbuild.Binary("kube-apiserver", "kube-apiserver", Version, "k8s.io/kubernetes/cmd/kube-apiserver")
}
