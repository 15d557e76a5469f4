package unixsock

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// helperEnv, when set, makes the test binary a second listener on the
// path it names (TestMain): a second agent's process. It prints whether it
// sees the lock held, then how its Listen went.
const helperEnv = "UNIXSOCK_TEST_SECOND_LISTENER"

func TestMain(m *testing.M) {
	if path := os.Getenv(helperEnv); path != "" {
		// The lock as the uninstall and a starting agent ask for it.
		fmt.Printf("held=%v ", Held(path))
		l, err := Listen("--api-socket", path, nil)
		if err == nil {
			l.Close()
			fmt.Println("listening")
			os.Exit(0)
		}
		if errors.Is(err, ErrInUse) {
			fmt.Println("in use:", err)
			os.Exit(0)
		}
		fmt.Println("error:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// TestSecondListenerInAnotherMountNamespace: a second agent in another
// mount namespace, which reaches the first's socket directory through a
// bind mount of its own at another path (two pods with the same hostPath,
// or an agent on the host and one in a pod), fails on the first's lock:
// flock holds on the inode, whichever mount it is reached through. The
// first's socket is left as it was, and serves.
func TestSecondListenerInAnotherMountNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root (a mount namespace with a bind mount): run the tests as root")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Fatalf("unshare (util-linux) not found: %v", err)
	}
	host := filepath.Join(t.TempDir(), "run-ipmasq")
	pod := filepath.Join(t.TempDir(), "pod-run-ipmasq")
	for _, d := range []string{host, pod} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	path := filepath.Join(host, "api.sock")
	l, err := Listen("--api-socket", path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	before := inode(t, path)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The bind mount exists only in the child's private mount namespace.
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount --bind "$1" "$2" && exec "$3"`, "sh", host, pod, self)
	cmd.Env = append(os.Environ(), helperEnv+"="+filepath.Join(pod, "api.sock"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("second listener: %v\n%s", err, out)
	}
	if !strings.HasPrefix(string(out), "held=true in use:") {
		t.Fatalf("second listener in another mount namespace: %q, want the lock held and the listener refused as in use", out)
	}
	if inode(t, path) != before {
		t.Fatal("the second listener replaced the first's socket")
	}
	serves(t, l, path)
	if entries, _ := os.ReadDir(pod); len(entries) != 0 {
		t.Fatalf("the bind mount leaked out of the child's namespace: %v", entries)
	}
}
