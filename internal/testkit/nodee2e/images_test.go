package nodee2e

import (
	"archive/tar"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Images of the node's pods, imported into containerd under these names
// (imagePullPolicy Never: nothing is pulled).
const (
	pauseImage = "localhost/ipmasq-nodee2e/pause:1"
	podImage   = "localhost/ipmasq-nodee2e/pod:1"
)

// goBuild builds a static binary of pkg (a package of this module) into dir.
func goBuild(t *testing.T, dir, pkg string) string {
	t.Helper()
	out := filepath.Join(dir, filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	return out
}

// writeImage writes a docker-archive tarball of a one-layer image holding
// bin as /usr/local/bin/<its name>, with entrypoint, for `ctr images import`.
func writeImage(t *testing.T, file, ref, bin string, entrypoint ...string) {
	t.Helper()
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	var layerTar bytes.Buffer
	tw := tar.NewWriter(&layerTar)
	for _, d := range []string{"usr/", "usr/local/", "usr/local/bin/", "tmp/"} {
		mode := int64(0o755)
		if d == "tmp/" {
			mode = 0o1777
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: mode}); err != nil {
			t.Fatal(err)
		}
	}
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: "usr/local/bin/" + filepath.Base(bin), Mode: 0o755, Size: int64(len(data))}
	if err := tw.WriteHeader(hdr); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	layer, err := tarball.LayerFromReader(bytes.NewReader(layerTar.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config = v1.Config{
		Entrypoint: entrypoint,
		Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin"},
	}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := tarball.WriteToFile(file, tag, img); err != nil {
		t.Fatalf("write image %s: %v", ref, err)
	}
}
