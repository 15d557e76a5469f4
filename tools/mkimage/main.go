// Command mkimage builds the ipmasq-agent container image without a
// container daemon and pushes it to a registry.
//
// Build: one OCI image index for linux/amd64 and linux/arm64 (one image
// per static binary given, its platform read from the ELF header), each
// image one layer holding the agent's binary and nothing else, written as
// an OCI image layout in a tarball that `ctr -n k8s.io images import`,
// `podman load` and `docker load` (Docker 25 and later) read:
//
//	CGO_ENABLED=0 GOARCH=amd64 go build -o bin/image/linux-amd64/ipmasq-agent ./cmd/ipmasq-agent
//	CGO_ENABLED=0 GOARCH=arm64 go build -o bin/image/linux-arm64/ipmasq-agent ./cmd/ipmasq-agent
//	go run ./tools/mkimage --binary bin/image/linux-amd64/ipmasq-agent \
//	    --binary bin/image/linux-arm64/ipmasq-agent --version v0.1.0 \
//	    --output bin/ipmasq-agent-image.tar
//
// Without --image the reference is the repository deploy/image/kustomization.yaml
// names with the version as its tag, and that file's newTag is rewritten to
// it, so that `kubectl apply -k deploy/` runs what `make image` built and a
// new build rolls the DaemonSet (a new tag is a new pod template). A
// version that does not name one content (a dirty tree, no git) gets the
// first 12 hex digits of the image index's digest appended: two builds
// never share a tag.
//
// Push: the index of such a tarball to a registry, with the credentials of
// ~/.docker/config.json (docker login, or a credential helper it names):
//
//	go run ./tools/mkimage push --archive bin/ipmasq-agent-image.tar \
//	    --image registry.example.com/net/ipmasq-agent:v0.1.0
//
// `make image` and `make push IMAGE=...` run these. The image runs as root
// (uid 0) with whatever capabilities the pod grants: docs/deploy.md says
// why not as another user.
//
// The program is a build tool: it is not linked into the agent; go.mod
// requires go-containerregistry for it (and the real-node test's images).
package main

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"sigs.k8s.io/yaml"
)

// BinaryPath is where the agent sits in the image. /usr/local/bin is on
// the image's PATH, so the DaemonSet's `command: [ipmasq-agent]` finds it.
const BinaryPath = "/usr/local/bin/ipmasq-agent"

// DeployImageFile is the kustomize component that names the agent's image
// for every manifest of deploy/; its reference is the default tag.
const DeployImageFile = "deploy/image/kustomization.yaml"

// Annotations on the index's entry in the layout's index.json: the name a
// runtime gives the image when it imports the tarball. containerd reads
// the first (and, failing it, the second); podman and Docker the second.
const (
	annotationContainerdName = "io.containerd.image.name"
	annotationRefName        = "org.opencontainers.image.ref.name"
)

// options say what to build and where to write it.
type options struct {
	// binaries are the agents to put in the image, one per architecture;
	// each must be statically linked (CGO_ENABLED=0): the image has no C
	// library.
	binaries []string
	// ref is the image reference the tarball carries (repository:tag),
	// the name a runtime gives the image when it imports it; empty: the
	// deploy component's repository with tagFor(version), written back
	// into deployFile.
	ref string
	// deployFile is the kustomize component naming the image for deploy/.
	deployFile string
	// version goes into the images' org.opencontainers.image.version label.
	version string
	// output is the OCI layout tarball to write.
	output string
	// created is the images' creation time and every file's mtime: the
	// commit time (SOURCE_DATE_EPOCH) makes the same commit build the
	// same image, byte for byte.
	created time.Time
}

// multiFlag is a flag given once per value.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(s string) error { *m = append(*m, s); return nil }

func main() {
	var err error
	if len(os.Args) > 1 && os.Args[1] == "push" {
		err = pushMain(os.Args[2:])
	} else {
		err = buildMain(os.Args[1:])
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "mkimage: %v\n", err)
		os.Exit(1)
	}
}

func buildMain(args []string) error {
	fl := flag.NewFlagSet("mkimage", flag.ContinueOnError)
	var o options
	var binaries multiFlag
	fl.Var(&binaries, "binary", "static ipmasq-agent binary (CGO_ENABLED=0) to put in the image; once per architecture (amd64, arm64)")
	fl.StringVar(&o.ref, "image", "", "image reference (repository:tag) recorded in the tarball (default: --deploy-image's repository, tagged with --version, and that file's newTag set to it)")
	fl.StringVar(&o.deployFile, "deploy-image", DeployImageFile, "the kustomize component whose images: entry names the default repository; its newTag is rewritten when --image is not given")
	fl.StringVar(&o.version, "version", "", "version for the images' org.opencontainers.image.version label and, without --image, their tag (default: the reference's tag)")
	fl.StringVar(&o.output, "output", "bin/ipmasq-agent-image.tar", "OCI image layout tarball to write")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fl.Args())
	}
	o.binaries = binaries
	if o.ref == "" && o.version == "" {
		return errors.New("give --version (the tag deploy/ gets) or --image")
	}
	created, err := sourceDateEpoch(os.Getenv("SOURCE_DATE_EPOCH"))
	if err != nil {
		return err
	}
	o.created = created
	digest, err := write(o)
	if err != nil {
		return err
	}
	if o.ref == "" {
		// write tagged it as the deploy component now says
		if o.ref, err = deployReference(o.deployFile); err != nil {
			return err
		}
		fmt.Printf("%s: newTag set: kubectl apply -k deploy/ runs this build\n", o.deployFile)
	}
	fmt.Printf("wrote %s: image %s (index %s)\n", o.output, o.ref, digest)
	return nil
}

// tagFor is the tag a build of version gets: the version itself (git
// describe's output is a valid tag), or, when it names no one content (a
// dirty tree: "-dirty"; no git: "unknown" or empty), the version followed
// by the first 12 hex digits of the index digest, so that re-importing a
// new build never keeps a tag the node already has.
func tagFor(version string, digest v1.Hash) string {
	var b strings.Builder
	for _, r := range version {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '_', r == '.', r == '-':
			b.WriteRune(r)
		default:
			b.WriteRune('-')
		}
	}
	tag := strings.TrimLeft(b.String(), ".-")
	if tag == "" || tag == "unknown" || strings.HasSuffix(tag, "-dirty") {
		tag = strings.TrimSuffix(tag+"-"+digest.Hex[:12], "-")
		tag = strings.TrimLeft(tag, "-")
	}
	if len(tag) > 128 { // the longest tag a registry takes
		tag = tag[len(tag)-128:]
	}
	return tag
}

func pushMain(args []string) error {
	fl := flag.NewFlagSet("mkimage push", flag.ContinueOnError)
	var archive, ref string
	fl.StringVar(&archive, "archive", "bin/ipmasq-agent-image.tar", "OCI image layout tarball `make image` wrote")
	fl.StringVar(&ref, "image", "", "where to push it: registry/repository:tag (required)")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fl.Args())
	}
	if ref == "" {
		return fmt.Errorf("push: --image is required (make push IMAGE=registry/repository:tag)")
	}
	digest, err := push(context.Background(), archive, ref, remote.WithAuthFromKeychain(authn.DefaultKeychain))
	if err != nil {
		return err
	}
	fmt.Printf("pushed %s to %s@%s\n", archive, ref, digest)
	return nil
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

// deployImage is the one images: entry of the kustomize component file.
type deployImage struct {
	Name    string `json:"name"`
	NewName string `json:"newName"`
	NewTag  string `json:"newTag"`
	Digest  string `json:"digest"`
}

func readDeployImage(file string) (deployImage, []byte, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return deployImage{}, nil, fmt.Errorf("the default image reference: %w (run from the repository's root, or give --image)", err)
	}
	var component struct {
		Images []deployImage `json:"images"`
	}
	if err := yaml.Unmarshal(data, &component); err != nil {
		return deployImage{}, nil, fmt.Errorf("%s: %w", file, err)
	}
	if len(component.Images) != 1 {
		return deployImage{}, nil, fmt.Errorf("%s: %d images: entries, want one", file, len(component.Images))
	}
	img := component.Images[0]
	if img.NewTag == "" || img.Digest != "" {
		return deployImage{}, nil, fmt.Errorf("%s: images: entry %q: want newTag (a tag make image can write), got newTag %q, digest %q", file, img.Name, img.NewTag, img.Digest)
	}
	return img, data, nil
}

// deployReference is the reference (newName:newTag) of the one images:
// entry of the kustomize component file.
func deployReference(file string) (string, error) {
	img, _, err := readDeployImage(file)
	if err != nil {
		return "", err
	}
	return img.repository() + ":" + img.NewTag, nil
}

func (img deployImage) repository() string {
	if img.NewName != "" {
		return img.NewName
	}
	return img.Name
}

// setDeployTag rewrites the newTag line of the component file to tag,
// leaving every other line (the comments) as it is; it returns the
// repository the entry names.
func setDeployTag(file, tag string) (string, error) {
	img, data, err := readDeployImage(file)
	if err != nil {
		return "", err
	}
	lines := strings.Split(string(data), "\n")
	n := 0
	for i, l := range lines {
		trimmed := strings.TrimSpace(l)
		if strings.HasPrefix(trimmed, "newTag:") {
			lines[i] = l[:len(l)-len(strings.TrimLeft(l, " "))] + "newTag: " + strconv.Quote(tag)
			n++
		}
	}
	if n != 1 {
		return "", fmt.Errorf("%s: %d newTag: lines, want one", file, n)
	}
	tmp := file + ".tmp"
	if err := os.WriteFile(tmp, []byte(strings.Join(lines, "\n")), 0o644); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, file); err != nil {
		return "", err
	}
	return img.repository(), nil
}

// write builds the image index and writes it as an OCI layout tarball
// naming it o.ref; it returns the index's digest.
func write(o options) (v1.Hash, error) {
	var tag name.Tag
	if o.ref != "" {
		var err error
		if tag, err = name.NewTag(o.ref, name.StrictValidation); err != nil {
			return v1.Hash{}, fmt.Errorf("--image %q: want repository:tag, e.g. ghcr.io/ipmasq/ipmasq-agent:v0.1.0: %w", o.ref, err)
		}
		if o.version == "" {
			o.version = tag.TagStr()
		}
	} else if _, _, err := readDeployImage(o.deployFile); err != nil {
		return v1.Hash{}, err // before the build: a bad file costs nothing
	}
	idx, err := buildIndex(o)
	if err != nil {
		return v1.Hash{}, err
	}
	digest, err := idx.Digest()
	if err != nil {
		return v1.Hash{}, err
	}
	if o.ref == "" {
		// The index's digest does not depend on the name: the tag can
		// carry it.
		t := tagFor(o.version, digest)
		repo, err := setDeployTag(o.deployFile, t)
		if err != nil {
			return v1.Hash{}, err
		}
		if tag, err = name.NewTag(repo+":"+t, name.StrictValidation); err != nil {
			return v1.Hash{}, fmt.Errorf("%s: %w", o.deployFile, err)
		}
		o.ref = tag.String()
	}
	if err := os.MkdirAll(filepath.Dir(o.output), 0o755); err != nil {
		return v1.Hash{}, err
	}
	// Written next to the target and renamed: a failed build never leaves
	// a truncated tarball that a later import would take for an image.
	tmp := o.output + ".tmp"
	if err := writeArchive(tmp, tag.String(), idx, o.created); err != nil {
		os.Remove(tmp)
		return v1.Hash{}, fmt.Errorf("write %s: %w", o.output, err)
	}
	if err := os.Rename(tmp, o.output); err != nil {
		return v1.Hash{}, err
	}
	return idx.Digest()
}

// buildIndex makes one image per binary and the index of them, each
// entry with its image's platform.
func buildIndex(o options) (v1.ImageIndex, error) {
	if len(o.binaries) == 0 {
		return nil, errors.New("no --binary: give one static agent per architecture")
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	seen := map[string]string{}
	var adds []mutate.IndexAddendum
	for _, bin := range o.binaries {
		arch, err := checkStatic(bin)
		if err != nil {
			return nil, err
		}
		if other, dup := seen[arch]; dup {
			return nil, fmt.Errorf("--binary %s and %s are both %s: want one binary per architecture", other, bin, arch)
		}
		seen[arch] = bin
		img, err := build(bin, arch, o)
		if err != nil {
			return nil, err
		}
		platform := v1.Platform{OS: "linux", Architecture: arch}
		if arch == "arm64" {
			// The variant runtimes match arm64 nodes with (containerd
			// normalizes arm64 to arm64/v8).
			platform.Variant = "v8"
		}
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &platform}})
	}
	// amd64 before arm64 whatever the flags' order: the same binaries
	// make the same index.
	slices.SortFunc(adds, func(a, b mutate.IndexAddendum) int {
		return strings.Compare(a.Descriptor.Platform.Architecture, b.Descriptor.Platform.Architecture)
	})
	return mutate.AppendManifests(idx, adds...), nil
}

// build makes one image: one layer with the binary at BinaryPath, run as
// root, for arch.
func build(binary, arch string, o options) (v1.Image, error) {
	bin, err := os.ReadFile(binary)
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
	cfg := &v1.ConfigFile{
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
	}
	if arch == "arm64" {
		cfg.Variant = "v8"
	}
	img, err = mutate.ConfigFile(img, cfg)
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
