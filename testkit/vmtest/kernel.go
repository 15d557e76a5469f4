// Package vmtest boots Debian's own kernels under qemu-system-x86_64 (TCG)
// with the host's root filesystem shared read-only by 9p under a tmpfs
// overlay, and runs one host command inside the guest: the harness that
// proves the datapath on the kernels users' nodes run (5.10, 6.1, 6.12).
//
// The kernels are Debian's linux-image packages, fetched with a private apt
// configuration (own sources.list, state and cache directories; the host's
// apt configuration is never read or changed) into the user's cache
// directory once, and extracted there; they are never installed on the host.
package vmtest

import (
	"bufio"
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// Mirror is the Debian archive the kernels come from.
const Mirror = "http://deb.debian.org/debian"

// securityMirror carries the kernels' security updates of bullseye and
// bookworm (a newer ABI than the main suite's, sometimes).
const securityMirror = "http://deb.debian.org/debian-security"

// keyring verifies the archive's Release files: the host's Debian archive
// keyring (package debian-archive-keyring, present on every Debian system).
const keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"

// Spec names one kernel of the matrix: the Debian suites its package comes
// from and the meta-package that depends on the newest concrete image.
type Spec struct {
	// Name is the kernel's short name on the command line and in results:
	// "5.10", "6.1", "6.12".
	Name string
	// Suites are the apt source lines' "URI suite" pairs.
	Suites []string
	// Meta is the meta-package whose Depends names the concrete
	// linux-image-<abi>-amd64 package.
	Meta string
	// Where says where users run this kernel (for the docs' table).
	Where string
}

// Kernels are the kernels of the matrix, oldest first.
var Kernels = []Spec{
	{
		Name:   "5.10",
		Suites: []string{Mirror + " bullseye", securityMirror + " bullseye-security"},
		Meta:   "linux-image-amd64",
		Where:  "Debian 11, Amazon Linux 2",
	},
	{
		Name:   "6.1",
		Suites: []string{Mirror + " bookworm", securityMirror + " bookworm-security"},
		Meta:   "linux-image-amd64",
		Where:  "Debian 12, Container-Optimized OS, Amazon Linux 2023",
	},
	{
		Name:   "6.12",
		Suites: []string{Mirror + " bookworm-backports"},
		Meta:   "linux-image-amd64",
		Where:  "Debian 12 backports, Debian 13",
	},
}

// Lookup returns the Spec of the kernel called name.
func Lookup(name string) (Spec, error) {
	var names []string
	for _, k := range Kernels {
		if k.Name == name {
			return k, nil
		}
		names = append(names, k.Name)
	}
	return Spec{}, fmt.Errorf("unknown kernel %q: want one of %s", name, strings.Join(names, ", "))
}

// Kernel is an extracted kernel package in the cache.
type Kernel struct {
	// Name is the Spec's name ("6.1").
	Name string
	// Package is the Debian package and its version, e.g.
	// "linux-image-6.1.0-41-amd64 6.1.158-1".
	Package string
	// Release is the kernel's release, uname -r in the guest, e.g.
	// "6.1.0-41-amd64": the directory under lib/modules.
	Release string
	// Vmlinuz is the kernel image's path (the package's compressed
	// bzImage).
	Vmlinuz string
	// Vmlinux is the uncompressed kernel (an ELF with a PVH entry) that
	// qemu boots: TCG takes about 10 s to run the bzImage's own
	// decompressor, and qemu loads this in about 2.
	Vmlinux string
	// Modules is the extracted lib/modules/<release>, with modules.dep
	// made by depmod.
	Modules string
}

// CacheDir is <user cache>/ipmasq/kernels.
func CacheDir() (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find a cache directory for the kernels: %w", err)
	}
	return filepath.Join(cache, "ipmasq", "kernels"), nil
}

// Fetch returns the kernel called name, downloading and extracting its
// Debian package into the cache the first time (about 70 MB per kernel).
// Once extracted, the kernel is reused without asking the mirror again:
// the cache's "ready" file names the package it holds; remove the kernel's
// cache directory to fetch the newest one. Concurrent callers wait for one
// download under a file lock.
func Fetch(name string) (*Kernel, error) {
	spec, err := Lookup(name)
	if err != nil {
		return nil, err
	}
	base, err := CacheDir()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(base, spec.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create %s: %w", dir, err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "fetch.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open fetch lock: %w", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return nil, fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)

	if k, err := readReady(spec.Name, dir); err == nil {
		return k, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	return download(spec, dir)
}

// readReady loads the kernel a previous Fetch left in dir.
func readReady(name, dir string) (*Kernel, error) {
	b, err := os.ReadFile(filepath.Join(dir, "ready"))
	if err != nil {
		return nil, err
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) != 2 {
		return nil, fmt.Errorf("%s: want 2 lines (package, release), have %q", filepath.Join(dir, "ready"), b)
	}
	root := filepath.Join(dir, "root")
	k := &Kernel{
		Name:    name,
		Package: lines[0],
		Release: lines[1],
		Vmlinuz: filepath.Join(root, "boot", "vmlinuz-"+lines[1]),
		Vmlinux: filepath.Join(dir, "vmlinux"),
		Modules: filepath.Join(root, "lib", "modules", lines[1]),
	}
	for _, p := range []string{k.Vmlinuz, k.Vmlinux, filepath.Join(k.Modules, "modules.dep")} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("kernel cache %s is incomplete (remove it to fetch again): %w", dir, err)
		}
	}
	return k, nil
}

// download runs apt-get with a private configuration rooted in dir/apt:
// update, then download of the concrete image the meta-package depends on,
// then dpkg-deb -x into dir/root and depmod there.
func download(spec Spec, dir string) (*Kernel, error) {
	for _, tool := range []string{"apt-get", "apt-cache", "dpkg-deb", "depmod", "xz", "zstd"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("fetch kernel %s: %s is not installed (Debian packages apt, dpkg, kmod, xz-utils, zstd; tools/deps.sh installs them): %w", spec.Name, tool, err)
		}
	}
	if _, err := os.Stat(keyring); err != nil {
		return nil, fmt.Errorf("fetch kernel %s: the Debian archive keyring is missing (package debian-archive-keyring): %w", spec.Name, err)
	}
	apt := filepath.Join(dir, "apt")
	for _, d := range []string{"state/lists/partial", "cache/archives/partial", "etc"} {
		if err := os.MkdirAll(filepath.Join(apt, d), 0o755); err != nil {
			return nil, err
		}
	}
	var sources strings.Builder
	for _, s := range spec.Suites {
		fmt.Fprintf(&sources, "deb [arch=amd64 signed-by=%s] %s main\n", keyring, s)
	}
	sourcesList := filepath.Join(apt, "etc", "sources.list")
	if err := os.WriteFile(sourcesList, []byte(sources.String()), 0o644); err != nil {
		return nil, err
	}
	// Every option that would otherwise come from the host's /etc/apt or
	// /var/lib/apt points into apt/: the host's apt state is neither read
	// (its sources, preferences and status) nor written.
	opts := []string{
		"-o", "Dir::Etc=" + filepath.Join(apt, "etc"),
		"-o", "Dir::Etc::sourcelist=" + sourcesList,
		"-o", "Dir::Etc::sourceparts=/dev/null",
		"-o", "Dir::Etc::preferencesparts=/dev/null",
		"-o", "Dir::Etc::parts=/dev/null",
		"-o", "Dir::State=" + filepath.Join(apt, "state"),
		"-o", "Dir::State::status=/dev/null",
		"-o", "Dir::Cache=" + filepath.Join(apt, "cache"),
		"-o", "APT::Architecture=amd64",
		"-o", "APT::Architectures=amd64",
		"-o", "Acquire::Languages=none",
		"-o", "Debug::NoLocking=1",
		"-o", "APT::Sandbox::User=root",
	}
	run := func(cwd, name string, args ...string) ([]byte, error) {
		cmd := exec.Command(name, args...)
		cmd.Dir = cwd
		cmd.Env = append(os.Environ(), "LC_ALL=C", "DEBIAN_FRONTEND=noninteractive")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return nil, fmt.Errorf("fetch kernel %s: %s %s: %w\n%s%s", spec.Name, name, strings.Join(args, " "), err, out, stderr.Bytes())
		}
		return out, nil
	}
	if _, err := run(dir, "apt-get", append(opts, "-q", "update")...); err != nil {
		return nil, err
	}
	show, err := run(dir, "apt-cache", append(opts, "show", "--no-all-versions", spec.Meta)...)
	if err != nil {
		return nil, err
	}
	image, err := concreteImage(show)
	if err != nil {
		return nil, fmt.Errorf("fetch kernel %s: %s: %w", spec.Name, spec.Meta, err)
	}
	debs := filepath.Join(dir, "debs")
	if err := os.RemoveAll(debs); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(debs, 0o755); err != nil {
		return nil, err
	}
	if _, err := run(debs, "apt-get", append(opts, "-q", "download", image)...); err != nil {
		return nil, err
	}
	files, _ := filepath.Glob(filepath.Join(debs, image+"_*.deb"))
	if len(files) != 1 {
		return nil, fmt.Errorf("fetch kernel %s: apt-get download %s left %d .deb files in %s", spec.Name, image, len(files), debs)
	}
	version, err := run(dir, "dpkg-deb", "-f", files[0], "Version")
	if err != nil {
		return nil, err
	}
	root := filepath.Join(dir, "root")
	if err := os.RemoveAll(root); err != nil {
		return nil, err
	}
	if _, err := run(dir, "dpkg-deb", "-x", files[0], root); err != nil {
		return nil, err
	}
	release := strings.TrimPrefix(strings.TrimSuffix(image, "-unsigned"), "linux-image-")
	if _, err := os.Stat(filepath.Join(root, "boot", "vmlinuz-"+release)); err != nil {
		return nil, fmt.Errorf("fetch kernel %s: %s has no boot/vmlinuz-%s: %w", spec.Name, files[0], release, err)
	}
	// Debian's packages leave modules.dep to their postinst; depmod with a
	// base directory writes it into the extracted tree only.
	if _, err := run(dir, "depmod", "-b", root, release); err != nil {
		return nil, err
	}
	if err := extractVmlinux(filepath.Join(root, "boot", "vmlinuz-"+release), filepath.Join(dir, "vmlinux")); err != nil {
		return nil, fmt.Errorf("fetch kernel %s: %w", spec.Name, err)
	}
	// The .deb is not needed again: only the extracted tree is used.
	if err := os.RemoveAll(debs); err != nil {
		return nil, err
	}
	if err := os.RemoveAll(apt); err != nil {
		return nil, err
	}
	ready := image + " " + strings.TrimSpace(string(version)) + "\n" + release + "\n"
	if err := os.WriteFile(filepath.Join(dir, "ready"), []byte(ready), 0o644); err != nil {
		return nil, err
	}
	return readReady(spec.Name, dir)
}

var imageDep = regexp.MustCompile(`^linux-image-[0-9][^ ,]*-amd64(-unsigned)?$`)

// concreteImage reads the Depends of `apt-cache show <meta>` and returns the
// concrete image package it names (signed if both are there).
func concreteImage(show []byte) (string, error) {
	s := bufio.NewScanner(bytes.NewReader(show))
	s.Buffer(make([]byte, 1<<20), 1<<20)
	var found []string
	for s.Scan() {
		line, ok := strings.CutPrefix(s.Text(), "Depends: ")
		if !ok {
			continue
		}
		for _, alt := range strings.FieldsFunc(line, func(r rune) bool { return r == ',' || r == '|' }) {
			name := strings.Fields(alt)
			if len(name) > 0 && imageDep.MatchString(name[0]) {
				found = append(found, name[0])
			}
		}
	}
	if len(found) == 0 {
		return "", fmt.Errorf("no linux-image-<abi>-amd64 in its Depends:\n%s", show)
	}
	// The signed image sorts before the -unsigned one of the same ABI.
	sort.Strings(found)
	return found[0], nil
}

// extractVmlinux finds the compressed kernel inside a bzImage (xz for
// Debian's 5.10 and 6.1, zstd for 6.12) and writes it uncompressed to out.
func extractVmlinux(vmlinuz, out string) error {
	b, err := os.ReadFile(vmlinuz)
	if err != nil {
		return err
	}
	for _, c := range []struct {
		magic []byte
		tool  []string
	}{
		{[]byte{0xfd, '7', 'z', 'X', 'Z', 0}, []string{"xz", "-dc", "--single-stream"}},
		{[]byte{0x28, 0xb5, 0x2f, 0xfd}, []string{"zstd", "-dc"}},
	} {
		for off := 0; ; {
			i := bytes.Index(b[off:], c.magic)
			if i < 0 {
				break
			}
			off += i
			cmd := exec.Command(c.tool[0], c.tool[1:]...)
			cmd.Stdin = bytes.NewReader(b[off:])
			var elfOut bytes.Buffer
			cmd.Stdout = &elfOut
			// The payload is followed by the bzImage's trailer, which
			// zstd reports as an error after writing the whole kernel:
			// the ELF's own layout decides whether it is complete.
			_ = cmd.Run()
			if completeELF(elfOut.Bytes()) {
				tmp := out + ".tmp"
				if err := os.WriteFile(tmp, elfOut.Bytes(), 0o644); err != nil {
					return err
				}
				return os.Rename(tmp, out)
			}
			off += len(c.magic)
		}
	}
	return fmt.Errorf("%s: found no xz or zstd compressed ELF kernel in it", vmlinuz)
}

// completeELF says whether b is an ELF file that holds all of its
// segments.
func completeELF(b []byte) bool {
	f, err := elf.NewFile(bytes.NewReader(b))
	if err != nil {
		return false
	}
	defer f.Close()
	if len(f.Progs) == 0 {
		return false
	}
	for _, p := range f.Progs {
		if p.Off+p.Filesz > uint64(len(b)) {
			return false
		}
	}
	return true
}
