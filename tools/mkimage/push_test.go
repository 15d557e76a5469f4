package main

import (
	"context"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// buildTiny builds a small static program for linux/arch: a binary of the
// architecture for tests that do not run it.
func buildTiny(t *testing.T, arch string) string {
	t.Helper()
	dir := t.TempDir()
	src := filepath.Join(dir, "main.go")
	if err := os.WriteFile(src, []byte("package main\n\nfunc main() { println(\"tiny\") }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "tiny-"+arch)
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", out, src)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch, "GO111MODULE=off")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build for %s: %v\n%s", arch, err, b)
	}
	return out
}

func TestRefusesTwoBinariesOfOneArch(t *testing.T) {
	bin := buildTiny(t, "arm64")
	_, err := write(options{binaries: []string{bin, bin}, ref: "example.org/x:1", output: filepath.Join(t.TempDir(), "x.tar")})
	if err == nil || !strings.Contains(err.Error(), "both arm64") {
		t.Fatalf("two arm64 binaries: %v, want an error naming arm64", err)
	}
	_, err = write(options{ref: "example.org/x:1", output: filepath.Join(t.TempDir(), "x.tar")})
	if err == nil || !strings.Contains(err.Error(), "no --binary") {
		t.Fatalf("no binary: %v, want an error naming --binary", err)
	}
}

// TestPush pushes the tarball to a registry on loopback (go-containerregistry's
// in-process implementation of the distribution API, served over HTTP)
// and pulls it back as a runtime of either architecture would: the same
// index, the same images, the same layers. A second push succeeds too
// (the registry has every blob: a re-push after a failed one).
func TestPush(t *testing.T) {
	archive := filepath.Join(t.TempDir(), "image.tar")
	digest, err := write(options{binaries: []string{buildTiny(t, "amd64"), buildTiny(t, "arm64")},
		ref: "example.org/ipmasq/ipmasq-agent:" + testVersion, output: archive})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	ref := host + "/net/ipmasq-agent:v9.9.9"
	for range 2 {
		pushed, err := push(context.Background(), archive, ref)
		if err != nil {
			t.Fatal(err)
		}
		if pushed != digest {
			t.Fatalf("push returned %v, want the archive's index %v", pushed, digest)
		}
	}

	tag, err := name.NewTag(ref)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Get(tag)
	if err != nil {
		t.Fatal(err)
	}
	if desc.Digest != digest || !desc.MediaType.IsIndex() {
		t.Fatalf("the registry serves %s as %s %v, want the index %v", ref, desc.MediaType, desc.Digest, digest)
	}
	_, _, localImgs := loadArchive(t, archive)
	remoteIdx, err := desc.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	remoteImgs := imagesOf(t, remoteIdx)
	for platform, img := range localImgs {
		want, _ := img.Digest()
		got, _ := remoteImgs[platform].Digest()
		if got != want {
			t.Errorf("%s: the registry's image %v, the archive's %v", platform, got, want)
		}
		// A pull by platform, as the node's runtime resolves the tag.
		os, arch, _ := strings.Cut(platform, "/")
		arch, variant, _ := strings.Cut(arch, "/")
		pulled, err := remote.Image(tag, remote.WithPlatform(v1.Platform{OS: os, Architecture: arch, Variant: variant}))
		if err != nil {
			t.Fatal(err)
		}
		layers, err := pulled.Layers()
		if err != nil || len(layers) != 1 {
			t.Fatalf("%s: %d layers (%v), want 1", platform, len(layers), err)
		}
		got, _ = layers[0].Digest()
		wantLayers, _ := img.Layers()
		want, _ = wantLayers[0].Digest()
		if got != want {
			t.Errorf("%s: pulled layer %v, the archive's %v", platform, got, want)
		}
	}
}

func TestPushNeedsImage(t *testing.T) {
	err := pushMain([]string{"--archive", "unused.tar"})
	if err == nil || !strings.Contains(err.Error(), "IMAGE=registry/repository:tag") {
		t.Fatalf("push without --image: %v, want an error naming IMAGE=", err)
	}
}
