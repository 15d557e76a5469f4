// Command mkimage builds the ipmasq-agent container image without a
// container daemon: one layer holding the agent's static binary and
// nothing else, written as a docker-archive tarball that `ctr -n k8s.io
// images import`, `docker load` and `podman load` read.
//
//	CGO_ENABLED=0 go build -o bin/image/ipmasq-agent ./cmd/ipmasq-agent
//	go run ./tools/mkimage --binary bin/image/ipmasq-agent \
//	    --image ghcr.io/ipmasq/ipmasq-agent:v0.1.0 --version v0.1.0 \
//	    --output bin/ipmasq-agent-image.tar
//
// `make image` runs both steps with the version from git describe. The
// image runs as root (uid 0) with whatever capabilities the pod grants:
// docs/deploy.md says why not as another user.
//
// The program is a build tool: it is not linked into the agent; go.mod
// requires go-containerregistry for it alone.
package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// BinaryPath is where the agent sits in the image. /usr/local/bin is on
// the image's PATH, so the DaemonSet's `command: [ipmasq-agent]` finds it.
const BinaryPath = "/usr/local/bin/ipmasq-agent"

// options say what to build and where to write it.
type options struct {
	// binary is the agent to put in the image; it must be statically
	// linked (CGO_ENABLED=0): the image has no C library.
	binary string
	// ref is the image reference the tarball carries (repository:tag),
	// the name a runtime gives the image when it loads it.
	ref string
	// version goes into the image's org.opencontainers.image.version label.
	version string
	// output is the docker-archive tarball to write.
	output string
	// created is the image's creation time and every file's mtime: the
	// commit time (SOURCE_DATE_EPOCH) makes the same commit build the
	// same image, byte for byte.
	created time.Time
}

func main() {
	var o options
	flag.StringVar(&o.binary, "binary", "bin/image/ipmasq-agent", "static ipmasq-agent binary to put in the image (CGO_ENABLED=0)")
	flag.StringVar(&o.ref, "image", "ghcr.io/ipmasq/ipmasq-agent:dev", "image reference (repository:tag) recorded in the tarball")
	flag.StringVar(&o.version, "version", "", "version for the image's org.opencontainers.image.version label (default: the reference's tag)")
	flag.StringVar(&o.output, "output", "bin/ipmasq-agent-image.tar", "docker-archive tarball to write")
	flag.Parse()
	if flag.NArg() > 0 {
		fail(fmt.Errorf("unexpected arguments %q", flag.Args()))
	}
	created, err := sourceDateEpoch(os.Getenv("SOURCE_DATE_EPOCH"))
	if err != nil {
		fail(err)
	}
	o.created = created
	digest, err := write(o)
	if err != nil {
		fail(err)
	}
	fmt.Printf("wrote %s: image %s (%s)\n", o.output, o.ref, digest)
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "mkimage: %v\n", err)
	os.Exit(1)
}

// sourceDateEpoch reads SOURCE_DATE_EPOCH (seconds since 1970, the
// reproducible-builds convention); unset: the Unix epoch, still
// reproducible.
func sourceDateEpoch(s string) (time.Time, error) {
	if s == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	sec, err := strconv.ParseInt(s, 10, 64)
	if err != nil || sec < 0 {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH=%q: want seconds since 1970", s)
	}
	return time.Unix(sec, 0).UTC(), nil
}

// write builds the image and writes it as a docker-archive tarball tagged
// with o.ref; it returns the image's manifest digest.
func write(o options) (v1.Hash, error) {
	tag, err := name.NewTag(o.ref, name.StrictValidation)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("--image %q: want repository:tag, e.g. ghcr.io/ipmasq/ipmasq-agent:v0.1.0: %w", o.ref, err)
	}
	if o.version == "" {
		o.version = tag.TagStr()
	}
	img, err := build(o)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := os.MkdirAll(filepath.Dir(o.output), 0o755); err != nil {
		return v1.Hash{}, err
	}
	// Written next to the target and renamed: a failed build never leaves
	// a truncated tarball that a later import would take for an image.
	tmp := o.output + ".tmp"
	if err := tarball.WriteToFile(tmp, tag, img); err != nil {
		os.Remove(tmp)
		return v1.Hash{}, fmt.Errorf("write %s: %w", o.output, err)
	}
	if err := os.Rename(tmp, o.output); err != nil {
		return v1.Hash{}, err
	}
	return img.Digest()
}

// build makes the image: one layer with the binary at BinaryPath, run as
// root, for the binary's architecture.
func build(o options) (v1.Image, error) {
	arch, err := checkStatic(o.binary)
	if err != nil {
		return nil, err
	}
	bin, err := os.ReadFile(o.binary)
	if err != nil {
		return nil, err
	}
	layerTar, err := layerOf(bin, o.created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	created := v1.Time{Time: o.created}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.ConfigFile(img, &v1.ConfigFile{
		Architecture: arch,
		OS:           "linux",
		Created:      created,
		Config: v1.Config{
			Entrypoint: []string{BinaryPath},
			Env:        []string{"PATH=/usr/local/bin"},
			// Root: see docs/deploy.md ("Why root"). Explicit, so that a
			// policy that inspects the image sees the choice.
			User: "0:0",
			Labels: map[string]string{
				"org.opencontainers.image.title":   "ipmasq-agent",
				"org.opencontainers.image.version": o.version,
				"org.opencontainers.image.source":  "https://github.com/ipmasq/ipmasq",
			},
		},
		RootFS: v1.RootFS{Type: "layers"},
	})
	if err != nil {
		return nil, err
	}
	return mutate.Append(img, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   created,
			CreatedBy: "tools/mkimage: " + BinaryPath,
		},
	})
}

// checkStatic refuses a binary that needs a dynamic loader (the image has
// none) and returns its architecture in GOARCH terms.
func checkStatic(binary string) (string, error) {
	f, err := elf.Open(binary)
	if err != nil {
		return "", fmt.Errorf("--binary %s: not an ELF executable: %w", binary, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			interp, _ := io.ReadAll(p.Open())
			return "", fmt.Errorf("--binary %s is dynamically linked (interpreter %s) and the image has no C library: build it with CGO_ENABLED=0",
				binary, bytes.TrimRight(interp, "\x00"))
		}
	}
	switch f.Machine {
	case elf.EM_X86_64:
		return "amd64", nil
	case elf.EM_AARCH64:
		return "arm64", nil
	default:
		return "", fmt.Errorf("--binary %s: machine %s: want x86-64 (amd64) or AArch64 (arm64)", binary, f.Machine)
	}
}

// layerOf is the layer's tar: the directories down to BinaryPath and the
// binary, owned by root, every mtime the build's.
func layerOf(bin []byte, mtime time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	var dirs []string
	for d := path.Dir(BinaryPath); d != "/"; d = path.Dir(d) {
		dirs = append([]string{d[1:] + "/"}, dirs...)
	}
	for _, d := range dirs {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: mtime, Format: tar.FormatPAX}); err != nil {
			return nil, err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: BinaryPath[1:], Mode: 0o755, Size: int64(len(bin)), ModTime: mtime, Format: tar.FormatPAX}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(bin); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("layer tar: %w", err)
	}
	return buf.Bytes(), nil
}
