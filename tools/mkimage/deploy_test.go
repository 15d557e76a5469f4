package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// TestMakeImageTagsWhatDeployNames: `make image` with no IMAGE names the
// image as deploy/image/kustomization.yaml does, and that is the image the
// DaemonSet of `kubectl apply -k deploy/` runs: importing the tarball on a
// node is all the install needs.
func TestMakeImageTagsWhatDeployNames(t *testing.T) {
	cmd := exec.Command("make", "-n", "image", "BIN=/nonexistent")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "IMAGE=")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("make -n image: %v\n%s", err, out)
	}
	mkimage := ""
	for _, l := range strings.Split(strings.ReplaceAll(string(out), "\\\n", " "), "\n") {
		if strings.Contains(l, "./tools/mkimage") {
			mkimage = l
		}
	}
	if mkimage == "" || strings.Contains(mkimage, "--image") || !strings.Contains(mkimage, "--deploy-image deploy/image/kustomization.yaml --version ") {
		t.Fatalf("make image runs %q: want ./tools/mkimage without --image, with --deploy-image deploy/image/kustomization.yaml and --version (it tags the build and sets deploy's newTag)\n%s", mkimage, out)
	}
	for _, arch := range []string{"linux-amd64", "linux-arm64"} {
		if !strings.Contains(mkimage, "--binary /nonexistent/image/"+arch+"/ipmasq-agent") {
			t.Errorf("make image runs %q: no --binary of %s", mkimage, arch)
		}
	}

	ref, err := deployReference("../../" + DeployImageFile)
	if err != nil {
		t.Fatal(err)
	}
	rendered := string(kubetest.Kustomize(t, "../../deploy", ""))
	if n := strings.Count(rendered, "image: "); n != 1 || !strings.Contains(rendered, "image: "+ref+"\n") {
		t.Fatalf("kustomize deploy/ names %d images, want the one image %s that make image writes:\n%s", n, ref, rendered)
	}
}

// TestShippedReferenceIsNoLatest: deploy/ names no :latest, and its pull
// policy never fetches another image under the name: the install and the
// uninstall Job alike.
func TestShippedReferenceIsNoLatest(t *testing.T) {
	for _, dir := range []string{"../../deploy", "../../deploy/uninstall"} {
		rendered := string(kubetest.Kustomize(t, dir, ""))
		if strings.Contains(rendered, ":latest") {
			t.Errorf("kustomize %s names :latest:\n%s", dir, rendered)
		}
		if n, never := strings.Count(rendered, "imagePullPolicy: "), strings.Count(rendered, "imagePullPolicy: Never\n"); n == 0 || n != never {
			t.Errorf("kustomize %s: %d pull policies, %d of them Never; want every one Never", dir, n, never)
		}
	}
}

// TestBuildSetsDeployTag: a build without --image tags the image with the
// version and writes that tag into the deploy component (comments kept),
// so deploy/ runs it and the next build rolls the DaemonSet; a dirty
// tree's tag carries the index digest, so two dirty builds never share a
// tag.
func TestBuildSetsDeployTag(t *testing.T) {
	dir := t.TempDir()
	component := filepath.Join(dir, "kustomization.yaml")
	original := "# keep me\nkind: Component\nimages:\n  - name: ghcr.io/ipmasq/ipmasq-agent\n    newName: registry.example.com/net/ipmasq-agent\n    # and me\n    newTag: \"unbuilt\"\n"
	if err := os.WriteFile(component, []byte(original), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := buildTiny(t, "amd64")
	build := func(version, out string) (string, v1.Hash) {
		t.Helper()
		digest, err := write(options{binaries: []string{bin}, version: version, deployFile: component, output: filepath.Join(dir, out)})
		if err != nil {
			t.Fatalf("build %s: %v", version, err)
		}
		ref, err := deployReference(component)
		if err != nil {
			t.Fatal(err)
		}
		if _, name, err := readArchive(filepath.Join(dir, out), t.TempDir()); err != nil || name != ref {
			t.Fatalf("%s is named %q (%v), want %q as the component now says", out, name, err, ref)
		}
		return ref, digest
	}
	ref, _ := build("v0.2.0", "clean.tar")
	if ref != "registry.example.com/net/ipmasq-agent:v0.2.0" {
		t.Errorf("clean build: deploy names %q, want registry.example.com/net/ipmasq-agent:v0.2.0", ref)
	}
	data, _ := os.ReadFile(component)
	if want := strings.Replace(original, `newTag: "unbuilt"`, `newTag: "v0.2.0"`, 1); string(data) != want {
		t.Errorf("component after the build:\n%s\nwant only newTag changed:\n%s", data, want)
	}

	dirty1, digest := build("v0.2.0-3-gabcdef0-dirty", "dirty1.tar")
	if want := "registry.example.com/net/ipmasq-agent:v0.2.0-3-gabcdef0-dirty-" + digest.Hex[:12]; dirty1 != want {
		t.Errorf("dirty build: %q, want %q", dirty1, want)
	}
	// Another dirty build of other content: another tag.
	bin = buildTiny(t, "arm64")
	if dirty2, _ := build("v0.2.0-3-gabcdef0-dirty", "dirty2.tar"); dirty2 == dirty1 {
		t.Errorf("two dirty builds of different binaries both tagged %s", dirty1)
	}
}

func TestTagFor(t *testing.T) {
	d := v1.Hash{Algorithm: "sha256", Hex: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}
	for version, want := range map[string]string{
		"v0.1.0":                 "v0.1.0",
		"f9267cf":                "f9267cf",
		"v0.1.0-2-gf9267cf":      "v0.1.0-2-gf9267cf",
		"f9267cf-dirty":          "f9267cf-dirty-0123456789ab",
		"unknown":                "unknown-0123456789ab",
		"":                       "0123456789ab",
		"release/1+build":        "release-1-build",
		strings.Repeat("a", 140): strings.Repeat("a", 128),
	} {
		if got := tagFor(version, d); got != want {
			t.Errorf("tagFor(%q) = %q, want %q", version, got, want)
		}
	}
}

func TestDeployReferenceRefusesDigest(t *testing.T) {
	f := t.TempDir() + "/kustomization.yaml"
	os.WriteFile(f, []byte("images:\n  - name: ghcr.io/ipmasq/ipmasq-agent\n    digest: sha256:0123\n"), 0o644)
	if _, err := deployReference(f); err == nil || !strings.Contains(err.Error(), "want newTag") {
		t.Fatalf("deployReference of a digest: %v, want an error asking for newTag", err)
	}
}

func TestPushTargetNeedsImage(t *testing.T) {
	cmd := exec.Command("make", "-n", "push")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "IMAGE=")
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "make push needs IMAGE=registry/repository:tag") {
		t.Fatalf("make -n push without IMAGE: %v\n%s\nwant a failure naming IMAGE=", err, out)
	}
}
