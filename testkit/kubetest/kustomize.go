package kubetest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// AgentImage is the image name deploy/'s manifests give the agent; the
// kustomization's images: entry (deploy/image) maps it to a registry and
// tag.
const AgentImage = "ghcr.io/ipmasq/ipmasq-agent"

// Kustomize renders the kustomization in dir the way `kubectl kustomize
// dir` does (kubectl embeds the same sigs.k8s.io/kustomize/api) and
// returns the YAML documents. A non-empty image (repository:tag or
// repository@digest) replaces AgentImage's reference through an overlay in
// a temporary directory, as an operator's own overlay would: e.g. the
// image `make image` built and a node imported.
func Kustomize(t testing.TB, dir, image string) []byte {
	t.Helper()
	abs, err := filepath.Abs(dir)
	if err != nil {
		t.Fatal(err)
	}
	root := abs
	if image != "" {
		root = t.TempDir()
		// kustomize takes no absolute resource directory.
		rel, err := filepath.Rel(root, abs)
		if err != nil {
			t.Fatal(err)
		}
		overlay := fmt.Sprintf("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - %s\nimages:\n  - name: %s\n%s",
			rel, AgentImage, imageFields(image))
		if err := os.WriteFile(filepath.Join(root, "kustomization.yaml"), []byte(overlay), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), root)
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
	}
	out, err := m.AsYaml()
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
	}
	if image != "" && !strings.Contains(string(out), "image: "+image+"\n") {
		t.Fatalf("kustomize %s with image %s: the output names another image; does the kustomization still call the agent's image %s?\n%s", dir, image, AgentImage, out)
	}
	return out
}

// imageFields are the images: entry's fields for a reference, quoted: a
// tag such as 1 or 1.2 would be a YAML number, which kustomize refuses.
func imageFields(image string) string {
	if repo, digest, ok := strings.Cut(image, "@"); ok {
		return fmt.Sprintf("    newName: %q\n    digest: %q\n", repo, digest)
	}
	// The tag follows the last colon after the last slash (a registry may
	// have a port).
	slash := strings.LastIndexByte(image, '/')
	if i := strings.LastIndexByte(image, ':'); i > slash {
		return fmt.Sprintf("    newName: %q\n    newTag: %q\n", image[:i], image[i+1:])
	}
	return fmt.Sprintf("    newName: %q\n", image)
}

// DecodeYAML reads the objects of YAML documents (e.g. Kustomize's
// output); name says where they came from in errors.
func DecodeYAML(t testing.TB, name string, data []byte) []runtime.Object {
	t.Helper()
	return decodeDocs(t, name, string(data))
}
