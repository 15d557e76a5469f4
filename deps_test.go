package ipmasq_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// fakeDebian is a PATH with dpkg-query, apt-get and id stand-ins: a package
// is installed when a file of its name is in dir/installed, apt-get install
// creates those files and records its arguments, id prints uid.
func fakeDebian(t *testing.T, uid string, installed ...string) (dir string) {
	t.Helper()
	dir = t.TempDir()
	db := filepath.Join(dir, "installed")
	if err := os.Mkdir(db, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range installed {
		if err := os.WriteFile(filepath.Join(db, p), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	scripts := map[string]string{
		"dpkg-query": `eval pkg=\${$#}; [ -e "` + db + `/$pkg" ] && printf 'ii ' || printf 'un '`,
		"apt-get": `echo "$*" >> "` + dir + `/apt-get.log"; [ "$1" = install ] || exit 0
for a in "$@"; do case "$a" in -*|install) ;; *) : > "` + db + `/$a" ;; esac; done`,
		"id": `echo ` + uid,
	}
	for name, body := range scripts {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func runDeps(t *testing.T, path string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command("/bin/sh", "tools/deps.sh")
	cmd.Env = append(os.Environ(), "PATH="+path+":/usr/bin:/bin")
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return o.String(), e.String(), code
}

var testPackages = []string{"make", "iproute2", "iptables", "etcd-server", "containerd", "runc", "containernetworking-plugins", "conntrack", "qemu-user", "qemu-system-x86", "kmod", "xz-utils", "zstd"}

// TestDepsInstallsMissingOnce: as root, the missing packages are installed
// with one line saying so, and a second run does nothing and says nothing.
func TestDepsInstallsMissingOnce(t *testing.T) {
	dir := fakeDebian(t, "0", "make", "iproute2", "iptables", "runc")
	out, errOut, code := runDeps(t, dir)
	want := "deps: installing missing Debian packages (once): etcd-server containerd containernetworking-plugins conntrack qemu-user qemu-system-x86 kmod xz-utils zstd\n"
	if code != 0 || out != want || errOut != "" {
		t.Fatalf("first run: exit %d, stdout %q, stderr %q; want exit 0 and stdout %q", code, out, errOut, want)
	}
	log, err := os.ReadFile(filepath.Join(dir, "apt-get.log"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(string(log), "install -y -qq etcd-server containerd containernetworking-plugins conntrack qemu-user qemu-system-x86 kmod xz-utils zstd\n") {
		t.Errorf("apt-get calls:\n%s", log)
	}
	out, errOut, code = runDeps(t, dir)
	if code != 0 || out != "" || errOut != "" {
		t.Fatalf("second run: exit %d, stdout %q, stderr %q; want nothing", code, out, errOut)
	}
	if again, _ := os.ReadFile(filepath.Join(dir, "apt-get.log")); !bytes.Equal(again, log) {
		t.Errorf("second run called apt-get again:\n%s", again)
	}
}

// TestDepsNotRoot: without root, one line naming the missing packages, exit 1,
// and no apt-get.
func TestDepsNotRoot(t *testing.T) {
	dir := fakeDebian(t, "1000", "make", "iproute2", "iptables")
	out, errOut, code := runDeps(t, dir)
	if code != 1 || out != "" || strings.Count(errOut, "\n") != 1 ||
		!strings.Contains(errOut, "missing Debian packages: etcd-server containerd runc containernetworking-plugins conntrack qemu-user qemu-system-x86 kmod xz-utils zstd") {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if _, err := os.Stat(filepath.Join(dir, "apt-get.log")); err == nil {
		t.Error("apt-get ran without root")
	}
}

// TestDepsAllPresent: nothing to do, nothing printed, whoever runs it.
func TestDepsAllPresent(t *testing.T) {
	for _, uid := range []string{"0", "1000"} {
		out, errOut, code := runDeps(t, fakeDebian(t, uid, testPackages...))
		if code != 0 || out != "" || errOut != "" {
			t.Errorf("uid %s: exit %d, stdout %q, stderr %q", uid, code, out, errOut)
		}
	}
}
