package main

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// writeArchive writes idx as an OCI image layout (oci-layout, index.json,
// blobs/sha256/...) in a tarball: index.json has one entry, idx, named ref
// by both annotations runtimes read. The tar's entries are sorted and
// owned by root with mtime, so the same index makes the same file.
func writeArchive(file, ref string, idx v1.ImageIndex, mtime time.Time) error {
	dir, err := os.MkdirTemp("", "mkimage-layout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{
		annotationContainerdName: ref,
		annotationRefName:        ref,
	})); err != nil {
		return err
	}
	var paths []string
	if err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && p != dir {
			paths = append(paths, p)
		}
		return err
	}); err != nil {
		return err
	}
	slices.Sort(paths)
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	for _, p := range paths {
		rel, _ := filepath.Rel(dir, p)
		rel = filepath.ToSlash(rel)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		h := &tar.Header{Name: rel, Mode: 0o644, ModTime: mtime, Format: tar.FormatPAX}
		if fi.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, rel+"/", 0o755
		} else {
			h.Typeflag, h.Size = tar.TypeReg, fi.Size()
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.IsDir() {
			continue
		}
		src, err := os.Open(p)
		if err != nil {
			return err
		}
		_, err = io.Copy(tw, src)
		src.Close()
		if err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}

// readArchive unpacks an OCI layout tarball writeArchive wrote into dir
// and returns its one index and the reference it is named by.
func readArchive(file, dir string) (v1.ImageIndex, string, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, "", fmt.Errorf("%s: %w", file, err)
		}
		if !filepath.IsLocal(h.Name) {
			return nil, "", fmt.Errorf("%s: entry %q leaves the layout", file, h.Name)
		}
		target := filepath.Join(dir, h.Name)
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(target, 0o755)
		case tar.TypeReg:
			if err = os.MkdirAll(filepath.Dir(target), 0o755); err == nil {
				var out *os.File
				if out, err = os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644); err == nil {
					_, err = io.Copy(out, tr)
					if cerr := out.Close(); err == nil {
						err = cerr
					}
				}
			}
		default:
			err = fmt.Errorf("entry %q has type %q: an OCI layout holds only directories and files", h.Name, h.Typeflag)
		}
		if err != nil {
			return nil, "", fmt.Errorf("%s: %w", file, err)
		}
	}
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, "", fmt.Errorf("%s: not an OCI image layout (make image writes one): %w", file, err)
	}
	m, err := top.IndexManifest()
	if err != nil {
		return nil, "", err
	}
	if len(m.Manifests) != 1 || !m.Manifests[0].MediaType.IsIndex() {
		return nil, "", fmt.Errorf("%s: index.json has %d entries, want one image index (make image writes one)", file, len(m.Manifests))
	}
	idx, err := top.ImageIndex(m.Manifests[0].Digest)
	if err != nil {
		return nil, "", err
	}
	return idx, m.Manifests[0].Annotations[annotationContainerdName], nil
}

// push uploads the index of the archive, its images and their blobs to
// ref; a registry that has a blob already is not sent it again. It
// returns the digest the registry now serves at ref.
func push(ctx context.Context, archive, ref string, opts ...remote.Option) (v1.Hash, error) {
	tag, err := name.NewTag(ref, name.StrictValidation)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("--image %q: want registry/repository:tag: %w", ref, err)
	}
	dir, err := os.MkdirTemp("", "mkimage-push-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.RemoveAll(dir)
	idx, _, err := readArchive(archive, dir)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := remote.WriteIndex(tag, idx, append(opts, remote.WithContext(ctx))...); err != nil {
		return v1.Hash{}, fmt.Errorf("push %s: %w", tag, err)
	}
	return idx.Digest()
}
