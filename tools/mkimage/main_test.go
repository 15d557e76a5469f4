package main

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// testVersion is stamped into the agent the tests build, the way `make
// image` stamps git describe.
const testVersion = "v0.0.0-imagetest"

// testRevision is stamped as the commit.
const testRevision = "0123456789abcdef"

// buildAgent builds cmd/ipmasq-agent for linux/arch as `make image`
// does: static, with the version linked into internal/buildinfo.
func buildAgent(t *testing.T, arch string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "ipmasq-agent")
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-trimpath",
		"-ldflags", "-X github.com/ipmasq/ipmasq/internal/buildinfo.version="+testVersion+
			" -X github.com/ipmasq/ipmasq/internal/buildinfo.revision="+testRevision,
		"-o", out, "./cmd/ipmasq-agent")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/ipmasq-agent: %v\n%s", err, b)
	}
	return out
}

func TestRefusesDynamicBinary(t *testing.T) {
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Fatalf("no sh to use as a dynamically linked binary: %v", err)
	}
	_, err = write(options{binaries: []string{sh}, ref: "example.org/x:1", output: filepath.Join(t.TempDir(), "x.tar")})
	if err == nil || !strings.Contains(err.Error(), "dynamically linked") || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
		t.Fatalf("write with %s: %v, want a dynamically linked error naming CGO_ENABLED=0", sh, err)
	}
}

func TestRefusesReferenceWithoutTag(t *testing.T) {
	_, err := write(options{binaries: []string{"unused"}, ref: "Not A Reference", output: filepath.Join(t.TempDir(), "x.tar")})
	if err == nil || !strings.Contains(err.Error(), `--image "Not A Reference"`) {
		t.Fatalf("got %v, want an error naming --image", err)
	}
}

// platforms are the image's, in the index's order.
var platforms = []string{"linux/amd64", "linux/arm64/v8"}

// buildIndexOfBoth builds the agent for amd64 and arm64 and writes the
// image of both to a tarball; it returns the binaries by GOARCH.
func buildIndexOfBoth(t *testing.T, ref, out string) (v1.Hash, map[string]string) {
	t.Helper()
	bins := map[string]string{"amd64": buildAgent(t, "amd64"), "arm64": buildAgent(t, "arm64")}
	// arm64 first: the index's order is the platforms', not the flags'.
	digest, err := write(options{binaries: []string{bins["arm64"], bins["amd64"]}, ref: ref, output: out})
	if err != nil {
		t.Fatal(err)
	}
	return digest, bins
}

// loadArchive reads the tarball as a runtime does: its one index, the
// name it gives it, and the image of each platform.
func loadArchive(t *testing.T, file string) (v1.ImageIndex, string, map[string]v1.Image) {
	t.Helper()
	idx, ref, err := readArchive(file, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return idx, ref, imagesOf(t, idx)
}

// imagesOf are the index's images by platform ("linux/arm64/v8"), in
// the index's order checked against platforms.
func imagesOf(t *testing.T, idx v1.ImageIndex) map[string]v1.Image {
	t.Helper()
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	imgs := map[string]v1.Image{}
	for _, d := range m.Manifests {
		if d.Platform == nil || d.MediaType != types.OCIManifestSchema1 {
			t.Fatalf("index entry %+v: want an OCI image manifest with a platform", d)
		}
		p := d.Platform.String()
		got = append(got, p)
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		imgs[p] = img
	}
	if !slices.Equal(got, platforms) {
		t.Fatalf("index platforms %q, want %q", got, platforms)
	}
	return imgs
}

// qemu is the qemu-user emulator of a GOARCH (Debian's qemu-user).
var qemu = map[string]string{"amd64": "qemu-x86_64", "arm64": "qemu-aarch64"}

// TestImage builds the image, checks what it holds: an index of a
// linux/amd64 and a linux/arm64 image, each the binary and its
// directories, nothing else; unpacks the layers of each into a scratch
// root and runs the agent from there: --version and --help (the other
// architecture's under qemu-user), then a real start of this machine's,
// chrooted into the scratch root, in a network namespace, on a private
// bpffs, with /proc and /sys as a container runtime gives them, until
// /healthz answers 200.
func TestImage(t *testing.T) {
	privtest.Require(t)
	const ref = "example.org/ipmasq/ipmasq-agent:" + testVersion
	out := filepath.Join(t.TempDir(), "image.tar")
	digest, bins := buildIndexOfBoth(t, ref, out)
	// The same binaries and time make the same image, byte for byte.
	againFile := filepath.Join(t.TempDir(), "again.tar")
	again, err := write(options{binaries: []string{bins["amd64"], bins["arm64"]}, ref: ref, output: againFile})
	if err != nil || again != digest {
		t.Fatalf("a second build: %v %v, want the same digest %v", again, err, digest)
	}
	if a, b := readFile(t, out), readFile(t, againFile); a != b {
		t.Fatalf("a second build wrote another tarball (%d and %d bytes)", len(a), len(b))
	}

	// 1. The tarball is an OCI layout whose one index is named by the
	// reference (what `ctr images import` calls it), and each platform's
	// config runs the binary as root.
	idx, name, imgs := loadArchive(t, out)
	if got, err := idx.Digest(); err != nil || got != digest {
		t.Fatalf("the tarball's index is %v (%v), want the digest write returned, %v", got, err, digest)
	}
	if name != ref {
		t.Fatalf("the tarball names its index %q, want %q", name, ref)
	}
	for platform, img := range imgs {
		cfg, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(cfg.Config.Entrypoint, []string{BinaryPath}) || cfg.Config.User != "0:0" ||
			cfg.Platform().String() != platform ||
			cfg.Config.Labels["org.opencontainers.image.version"] != testVersion {
			t.Fatalf("image config of %s: %+v", platform, cfg)
		}
	}

	// 2. Each image's layers, unpacked: the binary and its directories
	// only, the binary the one built for the platform.
	roots := map[string]string{}
	for arch, bin := range bins {
		platform := "linux/" + arch
		if arch == "arm64" {
			platform += "/v8"
		}
		root := filepath.Join(t.TempDir(), "rootfs-"+arch)
		files := unpack(t, imgs[platform], root)
		if want := []string{"usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/ipmasq-agent"}; !slices.Equal(files, want) {
			t.Fatalf("image %s holds %q, want %q", platform, files, want)
		}
		if readFile(t, filepath.Join(root, BinaryPath)) != readFile(t, bin) {
			t.Fatalf("image %s holds another binary than the %s build", platform, arch)
		}
		roots[arch] = root
	}

	// 3. --version and --help of each binary in the image; the other
	// architecture's under qemu-user, which translates its system calls.
	for arch, root := range roots {
		for _, flag := range []string{"--version", "--help"} {
			cmd := exec.Command(filepath.Join(root, BinaryPath), flag)
			if arch != runtime.GOARCH {
				q, err := exec.LookPath(qemu[arch])
				if err != nil {
					t.Fatalf("%s not found (%v): the Debian package qemu-user runs the %s binary", qemu[arch], err, arch)
				}
				cmd = exec.Command(q, filepath.Join(root, BinaryPath), flag)
			}
			v, err := cmd.CombinedOutput()
			want := "ipmasq-agent " + testVersion + " (go" // --version
			if flag == "--help" {
				want = "Masquerade agent for Linux and Kubernetes nodes, in eBPF"
			}
			if err != nil || !strings.HasPrefix(string(v), want) {
				t.Fatalf("%s ipmasq-agent %s: %v: %q, want %q...", arch, flag, err, v, want)
			}
			if flag == "--version" && !strings.Contains(string(v), "linux/"+arch+")") {
				t.Fatalf("%s ipmasq-agent --version: %q, want linux/%s", arch, v, arch)
			}
		}
	}

	// 4. Both binaries embed the one eBPF object bpf2go generated
	// (little-endian, bpfel), byte for byte: the object the kernel of the
	// start below verifies is the one an arm64 node's kernel gets.
	obj := readFile(t, "../../bpf/masq_bpfel.o")
	for arch, root := range roots {
		if !strings.Contains(readFile(t, filepath.Join(root, BinaryPath)), obj) {
			t.Fatalf("the %s binary does not embed bpf/masq_bpfel.o", arch)
		}
	}
	root := roots[runtime.GOARCH]
	cfg, err := imgs["linux/"+runtime.GOARCH].ConfigFile()
	if err != nil {
		t.Fatal(err)
	}

	// 5. A real start in the node namespace, chrooted into the image's
	// files: the DaemonSet's paths (the defaults) resolve inside it.
	topo, err := topology.NewMasquerade()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { topo.Close() })
	containerMounts(t, topo.Node, root)
	logPath := filepath.Join(t.TempDir(), "agent.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	cmd := exec.Command(BinaryPath, "--prometheus-serve-addr=127.0.0.1:9464", "--pod-cidr="+topology.PodCIDR4)
	cmd.Env = cfg.Config.Env
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := topo.Node.Start(cmd); err != nil {
		t.Fatalf("start the agent chrooted into the image: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-exited
		}
	})
	eth0, err := topo.Node.NL.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	pins := []string{
		filepath.Join(root, "sys/fs/bpf/ipmasq/links", fmt.Sprintf("%d-egress", eth0.Attrs().Index)),
		filepath.Join(root, "sys/fs/bpf/ipmasq/links", fmt.Sprintf("%d-ingress", eth0.Attrs().Index)),
	}
	// Ready: /healthz answers 200, the hive has started (SIGTERM is
	// handled from then on) and the datapath is attached to the node's
	// uplink, its links pinned in the private bpffs.
	client := httpIn(topo.Node)
	var healthz int
	var started, attached bool
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); {
		select {
		case err := <-exited:
			t.Fatalf("agent exited before it was ready: %v\n%s", err, readFile(t, logPath))
		case <-time.After(100 * time.Millisecond):
		}
		if resp, err := client.Get("http://127.0.0.1:9464/healthz"); err == nil {
			healthz = resp.StatusCode
			resp.Body.Close()
		}
		started = strings.Contains(readFile(t, logPath), `msg="Started hive"`)
		attached = exists(pins...)
		if healthz == http.StatusOK && started && attached {
			break
		}
	}
	if healthz != http.StatusOK || !started || !attached {
		t.Fatalf("not ready within 60 s: /healthz %d, hive started %v, links %q pinned %v\n%s",
			healthz, started, pins, attached, readFile(t, logPath))
	}

	// 6. The version is in the start log line and in ipmasq_build_info.
	resp, err := client.Get("http://127.0.0.1:9464/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := `ipmasq_build_info{goversion="` + runtime.Version() + `",revision="` + testRevision + `",version="` + testVersion + `"} 1`; !hasLine(string(metrics), want) {
		t.Errorf("/metrics has no ipmasq_build_info for %s:\n%s", testVersion, grepLines(string(metrics), "ipmasq_build_info"))
	}
	if log := readFile(t, logPath); !hasLine(log, `msg="Starting ipmasq-agent"`, "version="+testVersion) {
		t.Errorf("no start line with version=%s in the log:\n%s", testVersion, log)
	}

	// 7. SIGTERM stops it cleanly.
	if err := cmd.Process.Signal(unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("agent after SIGTERM: %v\n%s", err, readFile(t, logPath))
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("agent did not stop within 30 s of SIGTERM")
	}
}

// unpack writes the image's layers into root, in order, and returns the
// paths they hold. Only directories and regular files are expected: the
// image is the binary and nothing else.
func unpack(t *testing.T, img v1.Image, root string) []string {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if !filepath.IsLocal(h.Name) {
				t.Fatalf("layer entry %q leaves the root", h.Name)
			}
			names = append(names, h.Name)
			p := filepath.Join(root, h.Name)
			switch h.Typeflag {
			case tar.TypeDir:
				if err := os.MkdirAll(p, h.FileInfo().Mode().Perm()); err != nil {
					t.Fatal(err)
				}
			case tar.TypeReg:
				f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, h.FileInfo().Mode().Perm())
				if err != nil {
					t.Fatal(err)
				}
				if _, err := io.Copy(f, tr); err != nil {
					t.Fatal(err)
				}
				if err := f.Close(); err != nil {
					t.Fatal(err)
				}
			default:
				t.Fatalf("layer entry %q has type %q: want only directories and the binary", h.Name, h.Typeflag)
			}
		}
		rc.Close()
	}
	return names
}

// containerMounts gives root what a container runtime mounts for the
// agent's container: /proc, a read-only /sys of the node's network
// namespace, and (the DaemonSet's hostPath volume) a bpffs on
// /sys/fs/bpf, here a private one. All are detached when the test ends.
func containerMounts(t *testing.T, node *topology.Netns, root string) {
	t.Helper()
	mount := func(fstype, target string, flags uintptr, data string) {
		t.Helper()
		p := filepath.Join(root, target)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		// sysfs shows the devices of the namespace that mounts it.
		if err := node.Do(func() error { return unix.Mount(fstype, p, fstype, flags, data) }); err != nil {
			t.Fatalf("mount %s on %s: %v", fstype, p, err)
		}
		t.Cleanup(func() {
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
				t.Errorf("unmount %s: %v", p, err)
			}
		})
	}
	const safe = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	mount("proc", "proc", safe, "")
	mount("sysfs", "sys", safe|unix.MS_RDONLY, "")
	mount("bpf", "sys/fs/bpf", safe, "mode=0700")
}

// httpIn is an HTTP client whose connections are made in n.
func httpIn(n *topology.Netns) *http.Client {
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			DisableKeepAlives: true,
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				var c net.Conn
				err := n.Do(func() (err error) {
					c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
					return err
				})
				return c, err
			},
		},
	}
}

// exists says whether every path exists.
func exists(paths ...string) bool {
	for _, p := range paths {
		if _, err := os.Stat(p); err != nil {
			return false
		}
	}
	return true
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return string(b)
}

// hasLine says whether one line of s contains every part.
func hasLine(s string, parts ...string) bool {
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if all(sc.Text(), parts) {
			return true
		}
	}
	return false
}

func all(line string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(line, p) {
			return false
		}
	}
	return true
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
