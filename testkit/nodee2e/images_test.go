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
	writeImageFiles(t, file, ref, []imageFile{{path: "usr/local/bin/" + filepath.Base(bin), src: bin}}, entrypoint...)
}

// imageFile is one entry of an image's layer: at path (relative to the
// image's root), a copy of the host's file src, or a symbolic link to link.
type imageFile struct{ path, src, link string }

// writeImageFiles writes a docker-archive tarball of a one-layer image
// holding files (and the directories above them, and /tmp), with
// entrypoint, for `ctr images import`.
func writeImageFiles(t *testing.T, file, ref string, files []imageFile, entrypoint ...string) {
	t.Helper()
	var layerTar bytes.Buffer
	tw := tar.NewWriter(&layerTar)
	dirs := map[string]bool{}
	dir := func(d string, mode int64) {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: mode}); err != nil {
			t.Fatal(err)
		}
		dirs[d] = true
	}
	dir("tmp", 0o1777)
	for _, f := range files {
		var parents []string
		for d := filepath.Dir(f.path); d != "." && !dirs[d]; d = filepath.Dir(d) {
			parents = append(parents, d)
		}
		for i := len(parents) - 1; i >= 0; i-- {
			dir(parents[i], 0o755)
		}
		if f.link != "" {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: f.path, Linkname: f.link, Mode: 0o777}); err != nil {
				t.Fatal(err)
			}
			continue
		}
		data, err := os.ReadFile(f.src)
		if err != nil {
			t.Fatal(err)
		}
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: f.path, Mode: 0o755, Size: int64(len(data))}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
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
		Env:        []string{"PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
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
