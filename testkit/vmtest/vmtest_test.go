package vmtest

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/testkit/privtest"
)

func TestConcreteImage(t *testing.T) {
	show := []byte("Package: linux-image-amd64\nVersion: 6.1.192-3\n" +
		"Depends: linux-image-6.1.0-57-amd64 (= 6.1.192-3)\nDescription: meta\n")
	got, err := concreteImage(show)
	if err != nil || got != "linux-image-6.1.0-57-amd64" {
		t.Fatalf("concreteImage = %q, %v; want linux-image-6.1.0-57-amd64", got, err)
	}
	// Backports' meta-package names the image with a "+deb12" ABI, and may
	// offer the unsigned image as an alternative.
	show = []byte("Depends: linux-image-6.12.95+deb12-amd64-unsigned (= 6.12.95-1~bpo12+1) | linux-image-6.12.95+deb12-amd64 (= 6.12.95-1~bpo12+1)\n")
	if got, err := concreteImage(show); err != nil || got != "linux-image-6.12.95+deb12-amd64" {
		t.Fatalf("concreteImage = %q, %v; want the signed image", got, err)
	}
	if _, err := concreteImage([]byte("Depends: linux-base\n")); err == nil || !strings.Contains(err.Error(), "no linux-image") {
		t.Fatalf("no image in Depends: err = %v", err)
	}
}

func TestModulesInOrder(t *testing.T) {
	dir := t.TempDir()
	dep := "kernel/fs/9p/9p.ko.xz: kernel/net/9p/9pnet.ko.xz kernel/fs/netfs/netfs.ko.xz\n" +
		"kernel/net/9p/9pnet_virtio.ko.xz: kernel/net/9p/9pnet.ko.xz\n" +
		"kernel/net/9p/9pnet.ko.xz:\n" +
		"kernel/fs/netfs/netfs.ko.xz:\n" +
		"kernel/fs/overlayfs/overlay.ko.xz:\n"
	if err := os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte("kernel/drivers/virtio/virtio_pci.ko\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := modulesInOrder(dir, bootModules)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"kernel/net/9p/9pnet.ko.xz", "kernel/net/9p/9pnet_virtio.ko.xz",
		"kernel/fs/netfs/netfs.ko.xz", "kernel/fs/9p/9p.ko.xz",
		"kernel/fs/overlayfs/overlay.ko.xz",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("order %v, want %v (dependencies first, built-in virtio_pci left out)", got, want)
	}
	if _, err := modulesInOrder(dir, []string{"veth"}); err == nil || !strings.Contains(err.Error(), "veth") {
		t.Fatalf("missing module: err = %v", err)
	}
}

// TestCPIONewc reads back what cpioWriter writes, as the kernel's
// unpacker does: 110-byte headers, names and data padded to 4 bytes.
func TestCPIONewc(t *testing.T) {
	var buf bytes.Buffer
	w := &cpioWriter{w: &buf}
	w.dir("dev")
	w.node("dev/console", 0o020600, 5, 1)
	w.file("init", 0o755, []byte("hello"))
	w.trailer()
	if w.err != nil {
		t.Fatal(w.err)
	}
	type entry struct {
		name        string
		mode        uint64
		data        string
		major, minr uint64
	}
	var got []entry
	b := buf.Bytes()
	for off := 0; off < len(b); {
		h := string(b[off : off+110])
		if h[:6] != "070701" {
			t.Fatalf("offset %d: magic %q", off, h[:6])
		}
		field := func(i int) uint64 {
			v, err := strconv.ParseUint(h[6+8*i:14+8*i], 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		size, namesize := int(field(6)), int(field(11))
		name := string(b[off+110 : off+110+namesize-1])
		off += (110 + namesize + 3) &^ 3
		data := string(b[off : off+size])
		off += (size + 3) &^ 3
		got = append(got, entry{name, field(1), data, field(9), field(10)})
	}
	want := []entry{
		{"dev", 0o040755, "", 0, 0},
		{"dev/console", 0o020600, "", 5, 1},
		{"init", 0o100755, "hello", 0, 0},
		{"TRAILER!!!", 0, "", 0, 0},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("archive holds %+v, want %+v", got, want)
	}
}

// TestRunInGuest boots 6.12 and runs a command: its output and exit status
// come back, the root is the host's under a writable overlay that leaves
// the host alone, and the guest's modules are the kernel package's
// (modprobe loads veth).
func TestRunInGuest(t *testing.T) {
	privtest.Require(t)
	k, err := Fetch("6.12")
	if err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(t.TempDir(), "written-in-guest")
	script := "uname -r; echo x > " + marker + " && echo overlay-writable; " +
		"modprobe veth && grep -q '^veth ' /proc/modules && echo veth-loaded; exit 3"
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var out bytes.Buffer
	r, err := Run(ctx, Options{Kernel: k, Argv: []string{"sh", "-c", script}, Output: &out})
	if err != nil {
		t.Fatal(err)
	}
	if r.ExitCode != 3 {
		t.Errorf("exit code %d, want 3", r.ExitCode)
	}
	for _, want := range []string{k.Release, "overlay-writable", "veth-loaded"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("guest output lacks %q:\n%s", want, out.String())
		}
	}
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Errorf("the guest's write reached the host's %s (stat: %v)", marker, err)
	}
	t.Logf("boot %.1fs, command %.1fs, wall %v", r.BootSeconds, r.RunSeconds, r.Wall.Round(100*time.Millisecond))
}
