package deploy_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// kustomizations are the directories an operator renders and applies:
// the install, and the uninstall Job.
var kustomizations = []string{".", "uninstall"}

// rendered decodes Kustomize's output into objects, for error messages
// named after the kustomization.
func rendered(t *testing.T, dir string, out []byte) []manifest {
	t.Helper()
	var ms []manifest
	for i, doc := range docSeparator.Split(string(out), -1) {
		var obj object
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			t.Fatalf("kustomize %s: document %d: %v", dir, i+1, err)
		}
		if len(obj) > 0 {
			ms = append(ms, manifest{file: "kustomize " + dir, doc: i + 1, obj: obj})
		}
	}
	return ms
}

func ids(ms []manifest) []string {
	var out []string
	for _, m := range ms {
		out = append(out, str(m.obj, "kind")+" "+str(m.obj, "metadata", "namespace")+"/"+str(m.obj, "metadata", "name"))
	}
	slices.Sort(out)
	return out
}

// TestKustomizationHasEveryManifest: `kubectl apply -k deploy/` installs
// every object of deploy/*.yaml, unchanged but for the image, and not the
// example ConfigMap of deploy/config/ (TestApplyLeavesExistingConfigMapAlone).
func TestKustomizationHasEveryManifest(t *testing.T) {
	files := slices.DeleteFunc(loadManifests(t), func(m manifest) bool { return filepath.Dir(m.file) != "." })
	out := rendered(t, ".", kubetest.Kustomize(t, ".", ""))
	if got, want := ids(out), ids(files); !slices.Equal(got, want) {
		t.Fatalf("kustomize deploy/ renders\n  %q\nwant every object of deploy/*.yaml\n  %q", got, want)
	}
}

// agentImages are the images of the containers (and init containers)
// of every pod template in ms.
func agentImages(ms []manifest) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		pod := get(m.obj, "spec", "template", "spec")
		for _, field := range []string{"containers", "initContainers"} {
			for _, c := range list(pod, field) {
				out[fmt.Sprintf("%s %s container %s", str(m.obj, "kind"), str(m.obj, "metadata", "name"), str(c, "name"))] = str(c, "image")
			}
		}
	}
	return out
}

// TestImageIsSetInOnePlace: deploy/image/kustomization.yaml decides the
// image of every container the install and the uninstall run, and an
// operator's overlay replaces it everywhere at once.
func TestImageIsSetInOnePlace(t *testing.T) {
	data, err := os.ReadFile("image/kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var component struct {
		Kind   string
		Images []struct{ Name, NewName, NewTag string }
	}
	if err := yaml.Unmarshal(data, &component); err != nil {
		t.Fatal(err)
	}
	if component.Kind != "Component" || len(component.Images) != 1 || component.Images[0].Name != kubetest.AgentImage {
		t.Fatalf("image/kustomization.yaml: want a Component with one images: entry for %s, got %+v", kubetest.AgentImage, component)
	}
	defaultImage := component.Images[0].NewName + ":" + component.Images[0].NewTag
	const override = "registry.example.com:5000/net/ipmasq-agent:v9.9.9"
	for _, dir := range kustomizations {
		for image, want := range map[string]string{"": defaultImage, override: override} {
			images := agentImages(rendered(t, dir, kubetest.Kustomize(t, dir, image)))
			if len(images) == 0 {
				t.Fatalf("kustomize %s: no container", dir)
			}
			for c, got := range images {
				if got != want {
					t.Errorf("kustomize %s (image %q): %s runs %q, want %q", dir, image, c, got, want)
				}
			}
		}
	}
}

// TestKustomizationsNeedNothingElse: each kustomization lists its own
// files and the image component, and nothing a plain `kubectl apply -k`
// would not find.
func TestKustomizationsNeedNothingElse(t *testing.T) {
	for _, dir := range kustomizations {
		data, err := os.ReadFile(dir + "/kustomization.yaml")
		if err != nil {
			t.Fatal(err)
		}
		var k struct {
			Resources, Components []string
		}
		if err := yaml.Unmarshal(data, &k); err != nil {
			t.Fatal(err)
		}
		for _, r := range k.Resources {
			if strings.Contains(r, "/") || strings.Contains(r, "://") {
				t.Errorf("%s/kustomization.yaml: resource %q: want a file of the directory", dir, r)
			}
		}
		if len(k.Components) != 1 || !strings.HasSuffix(k.Components[0], "image") {
			t.Errorf("%s/kustomization.yaml: components %q, want the image component", dir, k.Components)
		}
	}
}

// TestAzureV2Component: the install with the component deploy/azure-v2,
// as its comment says to use it, has ip-masq-agent-v2's ConfigMaps
// projected into the config folder (each optional, each file named
// ip-masq*) and v2's flags.
func TestAzureV2Component(t *testing.T) {
	root := t.TempDir()
	deploy, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(root, deploy)
	if err != nil {
		t.Fatal(err)
	}
	k := fmt.Sprintf("resources:\n  - %s\ncomponents:\n  - %s/azure-v2\n", rel, rel)
	if err := os.WriteFile(filepath.Join(root, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	out := rendered(t, "with azure-v2", kubetest.Kustomize(t, root, ""))
	base := rendered(t, ".", kubetest.Kustomize(t, ".", ""))
	if got, want := ids(out), ids(base); !slices.Equal(got, want) {
		t.Fatalf("the overlay renders %q, want the install's %q", got, want)
	}
	var ds object
	for _, m := range out {
		if str(m.obj, "kind") == "DaemonSet" {
			ds = m.obj
		}
	}
	spec := ds["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
	args := fmt.Sprint(spec["containers"].([]any)[0].(map[string]any)["args"])
	for _, want := range []string{"--ip-masq-agent-config-path=/etc/config/ip-masq-agent", "--ip-masq-agent-v2", "--resync-interval=60"} {
		if !strings.Contains(args, want) {
			t.Errorf("args %s lack %s", args, want)
		}
	}
	var sources []any
	for _, v := range spec["volumes"].([]any) {
		if v := v.(map[string]any); v["name"] == "config" {
			if _, ok := v["configMap"]; ok {
				t.Errorf("the config volume is still a plain configMap volume: %v", v)
			}
			sources = v["projected"].(map[string]any)["sources"].([]any)
		}
	}
	want := map[string]string{"ip-masq-agent": "ip-masq-agent", "azure-ip-masq-agent-config": "ip-masq-agent-user",
		"azure-ip-masq-agent-config-reconciled": "ip-masq-agent-reconciled"}
	for _, s := range sources {
		cm := s.(map[string]any)["configMap"].(map[string]any)
		name := cm["name"].(string)
		path := cm["items"].([]any)[0].(map[string]any)["path"].(string)
		if want[name] != path || cm["optional"] != true || !strings.HasPrefix(path, "ip-masq") {
			t.Errorf("projected ConfigMap %s at %s (optional %v); want it optional at %q, a name the agent merges", name, path, cm["optional"], want[name])
		}
		delete(want, name)
	}
	if len(want) > 0 {
		t.Errorf("ConfigMaps not projected: %v", want)
	}
}
