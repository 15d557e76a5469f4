package deploy_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// Network configs of common CNIs, as they name them in /etc/cni/net.d. The
// runtime (libcni's ConfFiles, sorted by name) takes the first one: ipmasq's
// must sort after every one of them, so that on a node with a network it
// never takes the pods over.
var otherCNIConfigs = []string{
	"00-multus.conf", "05-cilium.conflist", "10-aws.conflist", "10-azure.conflist", "10-calico.conflist",
	"10-canal.conflist", "10-containerd-net.conflist", "10-flannel.conflist", "10-kindnet.conflist",
	"10-kuberouter.conflist", "10-weave.conflist", "11-crio-ipv4-bridge.conflist", "15-azure-swift.conflist",
	"20-antrea.conflist", "87-podman-bridge.conflist",
}

// cniConfig is the one network config deploy/cni ships.
func cniConfig(t *testing.T) (name string, conf map[string]any) {
	t.Helper()
	files, err := filepath.Glob("cni/*.conflist")
	if err != nil || len(files) != 1 {
		t.Fatalf("deploy/cni: %q (%v), want one .conflist", files, err)
	}
	data, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &conf); err != nil {
		t.Fatalf("%s: %v", files[0], err)
	}
	return filepath.Base(files[0]), conf
}

// TestCNIConfigNeverShadowsANetwork: the shipped network config sorts after
// every common CNI's (a prefix of 90 or more), so a node that has a network
// keeps it; it is a network of its own ("ipmasq") whose IPAM is ipmasq-cni.
func TestCNIConfigNeverShadowsANetwork(t *testing.T) {
	name, conf := cniConfig(t)
	m := regexp.MustCompile(`^([0-9]+)-`).FindStringSubmatch(name)
	if m == nil {
		t.Fatalf("deploy/cni/%s: want a numeric prefix (NN-name.conflist)", name)
	}
	if n, _ := strconv.Atoi(m[1]); n < 90 {
		t.Errorf("deploy/cni/%s: prefix %d sorts before other networks' configs; want 90 or more", name, n)
	}
	all := append(slices.Clone(otherCNIConfigs), name)
	slices.Sort(all)
	if all[len(all)-1] != name {
		t.Errorf("deploy/cni/%s sorts before %q: the runtime would take it instead of that network", name, all[len(all)-1])
	}
	if conf["name"] != "ipmasq" {
		t.Errorf("deploy/cni/%s: network name %v, want ipmasq", name, conf["name"])
	}
	plugins, _ := conf["plugins"].([]any)
	if len(plugins) == 0 {
		t.Fatalf("deploy/cni/%s has no plugins", name)
	}
	ipam, _ := plugins[0].(map[string]any)["ipam"].(map[string]any)
	if ipam["type"] != "ipmasq-cni" {
		t.Errorf("deploy/cni/%s: the first plugin's ipam is %v, want ipmasq-cni", name, ipam["type"])
	}
}

// TestDefaultInstallHasNoCNI: `kubectl apply -k deploy/` installs no CNI:
// nothing it renders writes the runtime's CNI directories or ships a
// network config, and the kustomization does not include deploy/cni. The
// install docs name the CNI step only as an option.
func TestDefaultInstallHasNoCNI(t *testing.T) {
	name, _ := cniConfig(t)
	out := kubetest.Kustomize(t, ".", "")
	for _, bad := range []string{"/etc/cni", "/opt/cni", ".conflist", "ipmasq-cni"} {
		if strings.Contains(string(out), bad) {
			t.Errorf("kustomize deploy/ renders %q: the default install must leave the node's CNI alone", bad)
		}
	}
	for _, m := range rendered(t, ".", out) {
		pod := get(m.obj, "spec", "template", "spec")
		for _, v := range list(pod, "volumes") {
			if p := str(v, "hostPath", "path"); strings.Contains(p, "cni") {
				t.Errorf("%s %s: hostPath volume %s", str(m.obj, "kind"), str(m.obj, "metadata", "name"), p)
			}
		}
	}
	data, err := os.ReadFile("kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(data), "cni") {
		t.Errorf("kustomization.yaml names the CNI:\n%s", data)
	}

	// docs/deploy.md: the install block installs no CNI, and the CNI
	// section is an option with the shipped file's name.
	doc, err := os.ReadFile("../docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	install := between(t, string(doc), "The whole install, the same on every node:", "The ConfigMap is kept out")
	for _, bad := range []string{"ipmasq-cni", "net.d", "conflist", "CNI"} {
		if strings.Contains(install, bad) {
			t.Errorf("docs/deploy.md: the whole install names %q:\n%s", bad, install)
		}
	}
	cni := between(t, string(doc), "## The CNI plugin (optional)", "\n## ")
	for _, want := range []string{"deploy/cni/" + name, "Only on nodes without a pod network"} {
		if !strings.Contains(cni, want) {
			t.Errorf("docs/deploy.md: the CNI section lacks %q", want)
		}
	}
	if strings.Contains(string(doc), "10-ipmasq") {
		t.Errorf("docs/deploy.md still names 10-ipmasq.conflist")
	}
}

// between returns the text of s from after start to before end.
func between(t *testing.T, s, start, end string) string {
	t.Helper()
	i := strings.Index(s, start)
	if i < 0 {
		t.Fatalf("no %q", start)
	}
	s = s[i+len(start):]
	if j := strings.Index(s, end); j >= 0 {
		s = s[:j]
	}
	return s
}
