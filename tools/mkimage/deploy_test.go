package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/ipmasq/ipmasq/internal/testkit/kubetest"
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
	if mkimage == "" || strings.Contains(mkimage, "--image") {
		t.Fatalf("make image runs %q: want ./tools/mkimage without --image (its default is deploy's reference)\n%s", mkimage, out)
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
